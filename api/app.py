"""The OpenAI-compatible FastAPI app: routes, auth, streaming and disconnects.

The app owns no engine: it reaches engines through a `Router`, so the same app runs in a Ray
Serve replica (engines are actors) and in a test process (engines in-process).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from api.errors import (
    RETRY_AFTER_S,
    APIError,
    as_api_error,
    install_error_handlers,
    model_not_found,
    unauthorized,
)
from api.formats import ChatFormat, CompletionFormat, Format, usage_of
from api.generation import Choice, Delta, start
from api.limits import Admission, BodyLimit, Slot
from api.metrics import Metrics
from api.protocol import SEED_MIN, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from api.router import Router
from api.text import TextModel
from api.tokenization import DetokenizeRequest, TokenizeRequest, chat_prompt, detokenize, tokenize, tokenizer_info
from api.tool_calls import ToolUse
from engine.config import Config
from engine.messages import InvalidRequestError, SamplingParams

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DISCONNECT_POLL_S = 0.25
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
HEALTH_TIMEOUT_S = 2.0

T = TypeVar("T")


def _json(obj: BaseModel) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def _event(data: Any) -> str:
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {text}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """The result of `work`, or None (with `work` cancelled) once the client has gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _collect(deltas: AsyncGenerator[Delta, None]) -> list[Delta]:
    async with aclosing(deltas) as ds:
        return [d async for d in ds]


def _wrap_seed(seed: int) -> int:
    """`seed` wrapped into the signed 64-bit range, so the seeds n choices derive from a valid
    seed stay valid."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


class _Server:
    """The state the routes share."""

    def __init__(self, cfg: Config, router: Router, model: TextModel) -> None:
        self.cfg = cfg
        self.router = router
        self.model = model
        self.metrics = Metrics()
        self.admission = Admission(cfg.inflight_limit)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name:
            raise model_not_found(name)

    def completion_choices(self, body: CompletionRequest) -> list[Choice]:
        n = body.num_choices
        max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        hide_output = max_tokens == 0
        if hide_output:
            if not body.echo:
                raise InvalidRequestError("max_tokens=0 is only allowed with echo=true", param="max_tokens")
            max_tokens = 1  # the prompt's forward samples a token anyway; it is not shown (as vLLM)
        # With echo, the prompt's logprobs come with the same number of alternatives.
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        sampling = body.sampling(max_tokens, body.logprobs is not None, body.logprobs or 0, prompt_logprobs)
        body.token_ids_in(self.model.check_ids)
        choices = []
        for p, prompt in enumerate(body.prompts()):
            ids = self.model.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._check_length(ids, "prompt", max_tokens, "max_tokens")
            self.model.check_ids(ids)
            echo = None
            if body.echo:
                echo = (
                    prompt if isinstance(prompt, str) else self.model.tokenizer.decode(ids, skip_special_tokens=False)
                )
            choices += [
                replace(self._choice(p * n + i, ids, sampling, i), echo=echo, hide_output=hide_output) for i in range(n)
            ]
        return choices

    def chat_choices(self, body: ChatCompletionRequest, tools: ToolUse | None) -> list[Choice]:
        ids = chat_prompt(
            self.model, body.messages, body.tools, bool(body.add_generation_prompt), bool(body.continue_final_message)
        )
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's default for chat: whatever the context leaves
            max_tokens = max(1, self.model.max_model_len - len(ids))
        self._check_length(ids, "messages", max_tokens, given)
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        sampling = body.sampling(max_tokens, bool(body.logprobs), body.top_logprobs or 0)
        if tools is not None and tools.grammar is not None:  # "required" or a named function: forced
            if sampling.structured is not None:
                raise InvalidRequestError(
                    f"this tool_choice holds the output to a call; it cannot be combined with {sampling.structured.param}",
                    param="tool_choice",
                )
            sampling = replace(sampling, structured=tools.grammar)
            sampling.validate()
        body.token_ids_in(self.model.check_ids)
        return [self._choice(i, ids, sampling, i) for i in range(body.num_choices)]

    def _check_length(self, ids: list[int], prompt_param: str, max_tokens: int, max_tokens_param: str) -> None:
        """The engine checks the length again (and the cache size, which only it knows); checked
        here first so the error names the field the client sent, an empty prompt never travels
        through a prefill engine's hand-over, and a huge one is not shipped to the engines."""
        limit = self.model.max_model_len
        if not ids:
            raise InvalidRequestError("the prompt is empty (it has no tokens)", param=prompt_param)
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the model's context is {limit}, and at least one is for the output",
                param=prompt_param,
            )
        if len(ids) + max_tokens > limit:
            raise InvalidRequestError(
                f"the prompt ({len(ids)} tokens) plus {max_tokens_param} ({max_tokens}) is "
                f"beyond the model's context of {limit} tokens",
                param=max_tokens_param,
            )

    @staticmethod
    def _choice(index: int, ids: list[int], sampling: SamplingParams, nth: int) -> Choice:
        # Choices of one prompt must differ yet stay reproducible: each gets its own seed.
        if nth and sampling.seed is not None:
            sampling = replace(sampling, seed=_wrap_seed(sampling.seed + nth))
        return Choice(index, ids, sampling, counts_prompt=nth == 0)

    async def run(
        self, request: Request, fmt: Format, choices: list[Choice], stream: bool, include_usage: bool
    ) -> Response:
        endpoint = request.url.path
        slot = self._admit(len(choices))
        streaming = False
        try:
            try:
                deltas = await start(self.router, self.model, self.metrics, choices, fmt.req_id)
            except asyncio.CancelledError:  # the client left before the first token; the streams aborted
                self.metrics.requests.labels(endpoint, "aborted").inc()
                raise
            if stream:
                events = self._events(endpoint, fmt, deltas, len(choices), include_usage, slot)
                streaming = True  # the stream gives the slot back when it ends
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                collected = await _unless_disconnected(request, _collect(deltas))
            except asyncio.CancelledError:  # the server dropped the request: its client went away
                self.metrics.requests.labels(endpoint, "aborted").inc()
                raise
        finally:
            if not streaming:
                slot.release()
        # Errors are counted where they are answered (`on_error`), a response that cannot be
        # written (a tool call tool_choice demanded is missing) among them.
        if collected is None:
            self.metrics.requests.labels(endpoint, "aborted").inc()
            return Response(status_code=499)  # nobody is listening any more
        response = _json(fmt.response(collected))
        self.metrics.requests.labels(endpoint, "success").inc()
        return response

    def _admit(self, num_choices: int) -> Slot:
        if num_choices > self.admission.limit:
            raise InvalidRequestError(
                f"{num_choices} choices are more than the server works on at once ({self.admission.limit})", param="n"
            )
        slot = self.admission.try_acquire(num_choices)
        if slot is None:
            raise APIError(
                503,
                f"The server is overloaded: {self.admission.in_flight} requests in flight; retry later.",
                type="service_unavailable_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return slot

    async def _events(
        self,
        endpoint: str,
        fmt: Format,
        deltas: AsyncGenerator[Delta, None],
        num_choices: int,
        include_usage: bool,
        slot: Slot,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events; a client that goes away closes this generator, which aborts its requests."""
        outcome, error = "aborted", None
        finals: list[Delta] = []
        try:
            async with aclosing(deltas) as ds:
                for chunk in fmt.opening_chunks(num_choices):
                    yield _event(chunk)
                async for d in ds:
                    if d.finish_reason is not None:
                        finals.append(d)
                    for chunk in fmt.chunks(d):
                        yield _event(chunk)
            if include_usage:
                yield _event(fmt.usage_chunk(usage_of(finals)))
            outcome = "success"
        except Exception as e:  # the response has started: the error goes into the stream
            error, outcome = as_api_error(e), "error"
        finally:
            slot.release()
            self.metrics.requests.labels(endpoint, outcome).inc()
        if error is not None:
            yield _event(error.body())
        yield "data: [DONE]\n\n"

    def on_error(self, request: Request, error: APIError) -> None:
        if request.url.path in GENERATION_PATHS:
            outcome = "overloaded" if error.status == 503 else "rejected" if error.status < 500 else "error"
            self.metrics.requests.labels(request.url.path, outcome).inc()


def _auth(keys: tuple[str, ...]) -> Any:
    accepted = [k.encode() for k in keys]

    async def check(authorization: str | None = Header(default=None)) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        # Every key is compared, each in constant time, so the time a refusal takes tells
        # neither which key came close nor how much of one matched.
        matches = [hmac.compare_digest(given, k) for k in accepted]
        if scheme.lower() != "bearer" or not any(matches):
            raise unauthorized()

    return Depends(check)


def create_app(
    cfg: Config, router: Router, model: TextModel | None = None, background: Callable[[], Awaitable[None]] | None = None
) -> FastAPI:
    """The app for `cfg`'s model, serving through `router` (closed when the app shuts down);
    `model` defaults to loading cfg.model's tokenizer and templates; `background` runs while
    the app does (the engine supervisor)."""
    server = _Server(cfg, router, model or TextModel.load(cfg.model, cfg.max_model_len))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncGenerator[None, None]:
        task = asyncio.ensure_future(background()) if background is not None else None
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await router.close()

    app = FastAPI(title="raypd", lifespan=lifespan)
    app.add_middleware(BodyLimit)
    app.state.server = server
    install_error_handlers(app, server.on_error)
    v1 = APIRouter(prefix="/v1", dependencies=[_auth(cfg.api_keys)] if cfg.api_keys else [])

    @v1.get("/models")
    async def models() -> Response:
        return _json(ModelList(data=[ModelCard(id=cfg.model_name, max_model_len=server.model.max_model_len)]))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        fmt = CompletionFormat(
            f"cmpl-{uuid.uuid4().hex}", cfg.model_name, server.model, body.logprobs, body.prompt_logprobs
        )
        return await server.run(request, fmt, server.completion_choices(body), bool(body.stream), body.include_usage)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        tools = ToolUse.of(body)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", cfg.model_name, server.model, bool(body.logprobs), tools)
        choices = server.chat_choices(body, tools)
        return await server.run(request, fmt, choices, bool(body.stream), body.include_usage)

    app.include_router(v1)
    # vLLM's routes, outside /v1 as in vLLM, behind the same key.
    tokens = APIRouter(dependencies=v1.dependencies)

    @tokens.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> Response:
        server.check_model(body.model)
        return _json(tokenize(server.model, body))

    @tokens.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        server.check_model(body.model)
        return _json(detokenize(server.model, body))

    @tokens.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return _json(tokenizer_info(server.model))

    app.include_router(tokens)

    @app.get("/health")
    async def health() -> Response:
        stats = await router.stats(HEALTH_TIMEOUT_S)
        missing = [e.name for e in router.engines if e.name not in stats]
        if missing:
            raise APIError(503, f"engine(s) not answering: {', '.join(missing)}", type="service_unavailable_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await server.metrics.render(router), media_type=CONTENT_TYPE_LATEST)

    return app
