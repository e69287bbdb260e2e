"""Bounds at the ingress: request bodies, enforced while they are read, and requests in flight.

The schema bounds each field, but a body is read and parsed whole before any field is
checked: a gigabyte of JSON would first be held in the ingress replica's memory, then parsed
into Python objects several times its size. The largest valid request is far smaller.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 64 * 2**20  # 64 prompts of the schema's longest text, as ASCII


class BodyLimit:
    """ASGI middleware: reading a body beyond `max_bytes` raises HTTP 413, at once when its
    Content-Length says so, else as soon as the chunks received pass the bound. The error
    is raised inside the app's body read, so the app's handlers answer it in OpenAI's shape."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            receive = self._refuse
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    await self._refuse()
            return message

        await self.app(scope, bounded, send)

    async def _refuse(self) -> Message:
        raise HTTPException(413, f"The request body is larger than {self.max_bytes} bytes.")


class Admission:
    """A bound on the engine requests (choices) the server works on at once, counted at the
    ingress: past it a request is refused at once with 503, before it reaches an engine or is
    queued anywhere, so a burst costs the server nothing that grows with the burst. The engines' own
    waiting queues (`max_waiting`) are a second bound behind this one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self, n: int) -> Slot | None:
        """A slot for `n` engine requests, or None when they do not fit."""
        if self.in_flight + n > self.limit:
            return None
        self.in_flight += n
        return Slot(self, n)


class Slot:
    """Admitted engine requests; `release` gives them back once, however often it is called,
    since a response can end on several paths (finished, failed, client gone)."""

    __slots__ = ("_admission", "_n")

    def __init__(self, admission: Admission, n: int) -> None:
        self._admission = admission
        self._n = n

    def release(self) -> None:
        self._admission.in_flight -= self._n
        self._n = 0
