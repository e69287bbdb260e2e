"""Every failure as OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`.

Routes raise; one layer of handlers maps exceptions to statuses, so no route builds an error
response itself. OpenAI answers 400 (not FastAPI's 422) for a body it cannot parse or whose
fields have the wrong type, and so does raypd. Nothing unexpected leaks a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException

from actors.client import EngineLostError
from api.text import TemplateError
from engine.messages import EngineOverloadedError, InvalidRequestError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error with its HTTP status and OpenAI's `type`, `param` and `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(name: str | None) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key; pass it as `Authorization: Bearer <key>`.",
        type="authentication_error",
        code="invalid_api_key",
    )


def as_api_error(exc: BaseException) -> APIError:
    """The API error for `exc`; exceptions raised in an engine actor arrive wrapped by Ray,
    which keeps the original as `cause` (the wrapper's text holds a remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, TemplateError):
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, RayActorError | EngineLostError):  # an engine died; its supervisor is bringing it back
        return APIError(
            503,
            "An engine is restarting; retry shortly.",
            type="service_unavailable_error",
            code="engine_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            503,
            f"The server is overloaded: {exc}",
            type="service_unavailable_error",
            code="engine_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"Internal server error ({type(exc).__name__}).", type="server_error")


def _most_specific(errors: Sequence[Any]) -> Any:
    """The error to report. A value that fits no member of a union (a prompt is text, texts,
    token ids or lists of them) gets one error per member; most say only "not of my type".
    The member whose error is about the value itself (a negative token id, a fifth stop
    string) is the one the client meant."""
    return next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])


def _unsupported(error: Any) -> APIError:
    """A field raypd does not implement, named as the client wrote it (a nested one by its path)."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    where = ".".join(loc)
    return APIError(400, f"`{where}` is not supported by this server", param=loc[0] if loc else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {errors[0].get('msg')}.")
    error = _most_specific(errors)
    if error.get("type") == "extra_forbidden":  # a field of OpenAI's or vLLM's schema raypd does not implement
        return _unsupported(error)
    # The path without "body" and without pydantic's names of union members
    # ("list[int]", "function-after[...]"): fields and list indices, as the client wrote them.
    loc = [
        str(part)
        for part in error.get("loc", ())
        if part != "body" and (isinstance(part, int) or str(part).isidentifier())
    ]
    # `param` names the request field; the message gives the path into lists and objects.
    where = ".".join(loc)
    return APIError(
        400, f"{where}: {error.get('msg')}" if where else str(error.get("msg")), param=loc[0] if loc else None
    )


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, APIError], None]) -> None:
    """Answer every exception a route raises in OpenAI's shape; `on_error` sees each one (metrics)."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        on_error(request, error)
        return error.response()

    async def on_api(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, as_api_error(exc))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(request, _validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return respond(request, APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for kind in (APIError, InvalidRequestError, TemplateError, EngineOverloadedError, Exception):
        app.add_exception_handler(kind, on_api)
