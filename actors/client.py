"""Async client of one engine: submit a request, stream its tokens, abort it.

The engine hands out outputs in batches (one `OutputBatch` per step for all requests); a
single poller task fans them out to per-request queues. The same client drives an in-process
`EngineCore` (tests, `bench --mode local`) and an `EngineActor` over Ray.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.output_channel import OutputFeed
from engine.messages import (
    ENGINE_FAILURE,
    EngineFailedError,
    InvalidRequestError,
    OutputBatch,
    RequestOutput,
    SamplingParams,
)
from kv.nixl.transfer_params import KVTransferParams

log = logging.getLogger(__name__)

_POLL_TIMEOUT_S = 1.0


class EngineLostError(RuntimeError):
    """The engine serving a request is gone (its actor died, or its step loop failed) while the
    request itself was fine: whatever it had produced stands, and the rest can be computed on
    another engine."""


def engine_lost(error: BaseException) -> bool:
    """Whether a call's error means the engine cannot serve the request: its actor died or could
    not be reached (Ray's RayActorError, ActorUnavailableError included: the request goes on
    elsewhere, though the supervisor replaces only a dead engine, serve/engines.py
    `engine_dead`), or its step loop failed (it then raises EngineFailedError from every call;
    Ray keeps that as `cause`)."""
    cause = getattr(error, "cause", None)
    return isinstance(error, RayActorError | EngineLostError | EngineFailedError) or isinstance(
        cause, EngineFailedError
    )


async def _nothing_to_close() -> None:
    return None


@dataclass(frozen=True, slots=True)
class EngineCalls:
    """How to reach an engine: three coroutines, local or remote, and what to close after."""

    add_request: Callable[..., Awaitable[None]]
    abort: Callable[[str], Awaitable[None]]
    get_outputs: Callable[[float], Awaitable[list[OutputBatch]]]
    close: Callable[[], Awaitable[None]] = _nothing_to_close

    @classmethod
    def local(cls, core: Any) -> EngineCalls:
        async def add(req_id: str, ids: list[int], sp: SamplingParams, **kw: Any) -> None:
            core.add_request(req_id, ids, sp, **kw)

        async def abort(req_id: str) -> None:
            core.abort(req_id)

        return cls(add, abort, core.get_outputs)

    @classmethod
    def remote(cls, slot: ActorSlot) -> EngineCalls:
        """An `EngineActor`, reached through whatever handle `slot` holds at call time. The
        engine sends this client only its own requests' outputs (actors/output_mux.py): other
        API replicas are clients of the same engine."""
        client_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

        async def add(req_id: str, ids: list[int], sp: SamplingParams, **kw: Any) -> None:
            await _unowned(slot.handle.add_request.remote, req_id, ids, sp, client_id=client_id, **kw)

        async def abort(req_id: str) -> None:
            await _unowned(slot.handle.abort.remote, req_id)

        outputs = RemoteOutputs(slot, client_id)
        return cls(add, abort, outputs.get, outputs.close)


class RemoteOutputs:
    """`get_outputs` of whichever engine actor a slot holds: read from the engine's output
    channel when it is on this node (actors/output_channel.py), by Ray calls when not. A new
    handle in the slot (a replaced engine) is asked for its channel at the next call."""

    def __init__(self, slot: ActorSlot, client_id: str = "") -> None:
        self._slot = slot
        self._client_id = client_id
        self._handle: Any = None
        self._feed: OutputFeed | None = None

    async def get(self, timeout: float) -> list[OutputBatch]:
        handle = self._slot.handle
        if handle is not self._handle:
            await self.close()
            node, address, pid = await _unowned(handle.open_output_channel.remote, os.getpid(), self._client_id)
            here = ray.get_runtime_context().get_node_id()
            self._feed = OutputFeed(address, pid) if node == here else None
            self._handle = handle
        if self._feed is None:
            return await _unowned(handle.get_outputs.remote, timeout, self._client_id)
        try:
            return await self._feed.get(timeout)
        except ConnectionError:
            self._handle = None  # the next call asks whatever engine the slot then holds
            raise

    async def close(self) -> None:
        if self._feed is not None:
            await self._feed.close()
        self._feed = None
        self._handle = None


def _unowned(submit: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Submit a Ray call outside the calling task's context. Ray cancels the calls a task made
    when the task is cancelled (Serve cancels a request's task when its client leaves, see
    ray-project/ray#52476), and it knows a call's parent from the context it was made in:
    the shared output poller, or an abort made on the way out, must not die with whichever
    request happened to submit it. A request that leaves is aborted explicitly instead."""
    return contextvars.Context().run(submit, *args, **kwargs)


class ActorSlot:
    """The current handle of a named engine actor: a supervisor that re-creates the actor puts
    the new handle here, and every later call goes to it."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle


class EngineClient:
    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._poller: asyncio.Task[None] | None = None

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        req_id: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        do_remote_decode: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until one carries a finish reason. Leaving the
        iteration early (a client went away) aborts the request so its blocks are freed.
        The last two arguments are the disaggregation hand-over (see EngineCore.add_request).
        Raises EngineLostError when the engine goes away under the request."""
        req_id = req_id or f"req-{uuid.uuid4().hex}"
        if req_id in self._queues:
            raise InvalidRequestError(f"request id {req_id!r} is already in use", param="request_id")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req_id] = queue
        try:
            await self.calls.add_request(
                req_id,
                prompt_token_ids,
                sampling,
                kv_transfer_params=kv_transfer_params,
                do_remote_decode=do_remote_decode,
            )
        except BaseException as e:
            self._queues.pop(req_id, None)
            if isinstance(e, Exception) and engine_lost(e):
                raise EngineLostError(f"engine unreachable: {e!r}") from e
            if not isinstance(e, Exception):
                # Cancelled while the call was in flight: the engine may have the request (a
                # remote call cannot be taken back), and nobody would ever abort it. If the
                # abort overtakes the call, the engine refuses the late request instead.
                await asyncio.shield(self.calls.abort(req_id))
            raise
        finished = False
        try:
            self._ensure_poller()
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None
                if out.finish_reason == "error" and (out.error or "").startswith(ENGINE_FAILURE):
                    raise EngineLostError(out.error)
                yield out
        finally:
            self._queues.pop(req_id, None)
            if not finished:
                await asyncio.shield(self.calls.abort(req_id))

    async def abort(self, req_id: str) -> None:
        await self.calls.abort(req_id)

    @property
    def num_active(self) -> int:
        """Requests this client is streaming."""
        return len(self._queues)

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while self._queues:
            try:
                outputs = await self.calls.get_outputs(_POLL_TIMEOUT_S)
            except Exception as e:  # the engine is gone: its requests end, to be resumed elsewhere
                log.warning("engine poll failed: %r", e)
                for req_id, queue in list(self._queues.items()):
                    queue.put_nowait(
                        RequestOutput(req_id, [], None, "error", error=f"{ENGINE_FAILURE}unreachable: {e!r}")
                    )
                return
            for batch in outputs:
                for out in batch:
                    q = self._queues.get(out.req_id)
                    if q is not None:
                        q.put_nowait(out)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await self.calls.close()
