"""An engine's outputs split among its clients: each API replica gets its own requests' outputs.

The engine publishes one `OutputBatch` per step for all its requests (engine/core.py), and a
client takes every batch published since it last asked. With more than one API replica, two
clients taking from one queue would each get the other's outputs, so the engine actor pumps its
core's batches here and keeps one queue per client: `add_request` names the client that sends
it (`own`), and each batch is cut into the parts of each client. A request's outputs all go to
one client, in order. Outputs of a request nobody owns (added without a client id: tests
calling the actor directly) go to the client "", and are dropped if no such client asked.

A client that stops taking its outputs (its replica died) is forgotten after `stale_s`: its
requests are aborted, so a dead replica's streams do not hold KV blocks until `max_tokens`.
Stale means outputs waiting `stale_s` since they came with nobody come for them: not a client
that is waiting in `get` (an output channel's pusher waits there through any idle spell), and
not one whose last call was long ago but whose outputs have only just come (a client polling
over Ray stops between requests). Counted from the last call, the first output after a minute
idle forgot the client that was waiting for it, and that client's pusher then waited on the
forgotten queue for good: every later request of that replica hung.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from engine.messages import OutputBatch

log = logging.getLogger(__name__)

STALE_CLIENT_S = 60.0


@dataclass(slots=True)
class _Queue:
    batches: list[OutputBatch] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pending_since: float = 0.0  # when `batches` last went from empty to not (`get` empties it)
    waiters: int = 0  # calls of `get` waiting on `ready`

    def stale(self, now: float, stale_s: float) -> bool:
        """Outputs have waited `stale_s` (0: any wait) since they came, with no call waiting for
        them."""
        return bool(self.batches) and not self.waiters and now - self.pending_since >= stale_s


def split(batch: OutputBatch, owner_of: Callable[[str], str]) -> dict[str, OutputBatch]:
    """`batch` cut into one batch per client, each keeping the order of its requests' outputs."""
    owners = {owner_of(r) for r in batch.req_ids} | {owner_of(o.req_id) for o in batch.others}
    if len(owners) == 1:
        return {owners.pop(): batch}
    parts = {c: OutputBatch() for c in owners}
    for req_id, token, num_prompt, num_output in zip(
        batch.req_ids, batch.token_ids, batch.num_prompt_tokens, batch.num_output_tokens, strict=True
    ):
        part = parts[owner_of(req_id)]
        part.req_ids.append(req_id)
        part.token_ids.append(token)
        part.num_prompt_tokens.append(num_prompt)
        part.num_output_tokens.append(num_output)
    for out in batch.others:
        parts[owner_of(out.req_id)].others.append(out)
    return parts


class OutputMux:
    """`take` waits for the batches the core published since it last returned; `abort` ends a
    request of a client that went away."""

    def __init__(
        self,
        take: Callable[[], Awaitable[list[OutputBatch]]],
        abort: Callable[[str], None],
        stale_s: float = STALE_CLIENT_S,
    ) -> None:
        self._take = take
        self._abort = abort
        self._stale_s = stale_s
        self._owner: dict[str, str] = {}
        self._queues: dict[str, _Queue] = {}
        self._pump: asyncio.Task[None] | None = None

    def own(self, req_id: str, client: str) -> None:
        """`client` sent `req_id`: its outputs go there until one finishes it."""
        self._ensure_pump()
        self._queue(client)
        if client:
            self._owner[req_id] = client

    def disown(self, req_id: str) -> None:
        """The engine refused `req_id`: no output will come for it."""
        self._owner.pop(req_id, None)

    async def get(self, client: str, timeout: float | None) -> list[OutputBatch]:
        """Everything published for `client` since its last call, waiting up to `timeout`."""
        self._ensure_pump()
        queue = self._queue(client)
        if not queue.batches:
            queue.waiters += 1
            try:
                await asyncio.wait_for(queue.ready.wait(), timeout)
            except TimeoutError:
                return []
            finally:
                queue.waiters -= 1
        out, queue.batches = queue.batches, []
        queue.ready.clear()
        return out

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)

    def _queue(self, client: str) -> _Queue:
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = _Queue()
        return queue

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())

    def _owner_of(self, req_id: str) -> str:
        return self._owner.get(req_id, "")

    async def _run(self) -> None:
        while True:
            for batch in await self._take():
                for client, part in split(batch, self._owner_of).items():
                    queue = self._queues.get(client)
                    if queue is not None:  # else nobody will ever read it (a forgotten client's)
                        if not queue.batches:
                            queue.pending_since = time.monotonic()
                        queue.batches.append(part)
                        queue.ready.set()
                for out in batch.others:
                    if out.finish_reason is not None:
                        self._owner.pop(out.req_id, None)
            self._forget_stale()

    def _forget_stale(self) -> None:
        now = time.monotonic()
        for client, queue in list(self._queues.items()):
            if client and queue.stale(now, self._stale_s):
                mine = [r for r, c in self._owner.items() if c == client]
                log.warning(
                    "output client %s left its outputs waiting %.0f s: aborting its %d requests",
                    client,
                    now - queue.pending_since,
                    len(mine),
                )
                del self._queues[client]
                for req_id in mine:
                    self._owner.pop(req_id, None)
                    self._abort(req_id)
