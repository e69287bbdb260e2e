"""The engines a router chooses among, each with its latest summary, changeable at run time.

A `Fleet` is the current list: engines can be added, removed or drained while requests run
(a policy only ever sees the list as it is at the decision). Summaries are pulled from every
engine each `poll_interval_s` (engine/summary.py), never per request, and only while some
decision reads them (not for a lone colocated engine). Between polls the router
adds what it has sent to each engine itself (`dispatched`), so a burst between two polls does
not all land on the engine that looked idle; a poll started after a dispatch already counts
it, so those entries are dropped then. An engine whose poll or call failed is `suspect` and
left out of decisions until a poll succeeds again (unless every engine is suspect): a request
resumed after losing its engine (api/migration.py) goes to another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from actors.client import engine_lost
from engine.summary import EngineSummary

if TYPE_CHECKING:
    from api.router import Engine

log = logging.getLogger(__name__)

FleetRole = Literal["colocated", "prefill", "decode"]
DEFAULT_POLL_INTERVAL_S = 0.1


@dataclass(slots=True)
class EngineState:
    """What the router knows of one engine: its last summary and cache digest, and the work it
    sent there since that summary was taken (tokens to prefill, requests)."""

    name: str
    role: FleetRole
    summary: EngineSummary | None = None
    cached: frozenset[int] = frozenset()
    checkpoints: frozenset[int] | None = None  # hybrid models (engine/summary.py)
    polled_at: float = 0.0  # when the poll that gave `summary` was sent (this process's clock)
    sent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, prompt tokens to compute)
    suspect: bool = False
    draining: bool = False

    @property
    def block_size(self) -> int | None:
        return self.summary.block_size if self.summary else None

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens queued ahead of a new request: waiting there, plus sent since."""
        return (self.summary.waiting_tokens if self.summary else 0) + sum(t for _, t in self.sent)

    @property
    def num_requests(self) -> int:
        """Requests running or waiting there, plus those sent since the summary."""
        held = self.summary.num_running + self.summary.num_waiting if self.summary else 0
        return held + len(self.sent)

    @property
    def free_tokens(self) -> int | None:
        """KV room left in tokens (cached blocks that may be evicted count as free); None before
        the first summary."""
        return self.summary.num_blocks_free * self.summary.block_size if self.summary else None

    def record(self, summary: EngineSummary, polled_at: float) -> None:
        self.summary = summary
        if summary.cached is not None:
            self.cached, self.checkpoints = summary.cached, summary.checkpoints
        self.polled_at = polled_at
        self.suspect = False
        while self.sent and self.sent[0][0] <= polled_at:
            self.sent.popleft()


class Fleet:
    """Engines by name, with their states, in the order they joined."""

    def __init__(self, members: Iterable[tuple[Engine, FleetRole]] = ()) -> None:
        self._engines: dict[str, Engine] = {}
        self._states: dict[str, EngineState] = {}
        for engine, role in members:
            self.add(engine, role)

    def add(self, engine: Engine, role: FleetRole) -> None:
        if engine.name in self._engines:
            raise ValueError(f"engine {engine.name} is already in the fleet")
        self._engines[engine.name] = engine
        self._states[engine.name] = EngineState(engine.name, role)

    def remove(self, name: str) -> Engine:
        """Take the engine out of every later decision; requests already on it go on."""
        self._states.pop(name)
        return self._engines.pop(name)

    def drain(self, name: str, draining: bool = True) -> None:
        """No new request goes to a draining engine; it stays in the fleet (and is polled)."""
        self._states[name].draining = draining

    @property
    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def engine(self, name: str) -> Engine:
        return self._engines[name]

    def state(self, name: str) -> EngineState:
        return self._states[name]

    def candidates(self, role: FleetRole) -> list[EngineState]:
        """The engines of `role` a new request may go to: not draining, and not suspect unless
        all are (a guess that fails is resumed; no candidate at all would fail the request)."""
        open_ = [s for s in self._states.values() if s.role == role and not s.draining]
        return [s for s in open_ if not s.suspect] or open_

    def dispatched(self, name: str, tokens: int) -> None:
        if (state := self._states.get(name)) is not None:
            state.sent.append((time.monotonic(), tokens))

    def lost(self, name: str) -> None:
        if (state := self._states.get(name)) is not None:
            state.suspect = True

    async def poll(self, timeout_s: float) -> None:
        """Pull every engine's summary once, concurrently; an engine that does not answer
        keeps its last summary, and turns suspect if it is gone."""

        async def one(name: str, engine: Engine) -> None:
            state = self._states.get(name)
            if state is None:
                return
            sent_at = time.monotonic()
            version = state.summary.cache_version if state.summary else None
            try:
                summary = await asyncio.wait_for(engine.summary(version), timeout_s)
            except Exception as e:
                log.debug("engine %s gave no routing summary: %r", name, e)
                state.suspect = state.suspect or engine_lost(e)  # busy is not dead
                return
            if self._states.get(name) is state:  # not removed or replaced meanwhile
                state.record(summary, sent_at)

        await asyncio.gather(*(one(n, e) for n, e in list(self._engines.items())))

    def chooses(self) -> bool:
        """Whether any routing decision reads the summaries: a choice between engines of one
        role, or a PD request's (whether its prompt is computed where it decodes). A single
        colocated engine takes every request whatever its summary says, and polling it anyway
        cost its event loop and the ingress's a Ray call every interval, on the cores the
        forward computes on."""
        roles = [s.role for s in self._states.values()]
        return len(roles) > len(set(roles)) or "prefill" in roles

    async def run(self, interval_s: float) -> None:
        """Poll every `interval_s` while a decision reads the summaries (engines come and go)."""
        while True:
            if self.chooses():
                await self.poll(timeout_s=max(interval_s * 10, 1.0))
            await asyncio.sleep(interval_s)
