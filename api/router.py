"""Which engine serves a request. Routes only call `Router.generate`, so the choice (round robin
over colocated engines, or a prefill engine then a decode engine under PD) can change without
touching them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from actors.client import ActorSlot, EngineCalls, EngineClient, EngineLostError
from api.migration import MigrationPolicy, resumable
from engine.messages import EngineStats, RequestOutput, SamplingParams


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine as the ingress sees it: a name (the `engine` label of its metrics), a client
    for its requests, and its stats. A remote engine's actor can be replaced (`rebind`)."""

    name: str
    client: EngineClient
    stats: Callable[[], Awaitable[EngineStats]]
    slot: ActorSlot | None = None

    @classmethod
    def remote(cls, name: str, handle: Any) -> Engine:
        """An `EngineActor` reached over Ray."""
        slot = ActorSlot(handle)

        async def stats() -> EngineStats:
            return await slot.handle.stats.remote()

        return cls(name, EngineClient(EngineCalls.remote(slot)), stats, slot)

    def rebind(self, handle: Any) -> None:
        """Send every later call to a re-created actor."""
        if self.slot is None:
            raise TypeError(f"engine {self.name} is in-process: it has no actor to replace")
        self.slot.handle = handle

    @classmethod
    def local(cls, name: str, core: Any) -> Engine:
        """An `EngineCore` in this process (tests)."""

        async def stats() -> EngineStats:
            return core.stats()

        return cls(name, EngineClient(EngineCalls.local(core)), stats)


class Router(ABC):
    def __init__(self, engines: Sequence[Engine], migration: MigrationPolicy) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.migration = migration
        self.num_resumed = 0  # tries after a lost engine (`raypd_requests_resumed_total`)

    def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until one carries a finish reason; leaving early aborts it. A
        request whose engine is lost goes on on another one (api/migration.py)."""
        return resumable(self._attempt, prompt_ids, sampling, req_id, self.migration, self._resumed)

    def _resumed(self) -> None:
        self.num_resumed += 1

    @abstractmethod
    def _attempt(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """One try on the engine(s) the router picks; raises EngineLostError if one goes away."""

    async def stats(self, timeout_s: float) -> dict[str, EngineStats]:
        """Each engine's stats; one that does not answer within `timeout_s` is left out, so a
        stuck engine cannot hang a metrics scrape."""

        async def one(engine: Engine) -> EngineStats | None:
            try:
                return await asyncio.wait_for(engine.stats(), timeout_s)
            except Exception:
                return None

        results = await asyncio.gather(*(one(e) for e in self.engines))
        return {e.name: s for e, s in zip(self.engines, results, strict=True) if s is not None}

    async def close(self) -> None:
        await asyncio.gather(*(e.client.close() for e in self.engines))


class RoundRobinRouter(Router):
    """Colocated engines, each taking every n-th request."""

    def __init__(self, engines: Sequence[Engine], migration: MigrationPolicy | None = None) -> None:
        super().__init__(engines, migration or MigrationPolicy())
        self._turn = itertools.cycle(self.engines)

    def _attempt(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        return next(self._turn).client.generate(prompt_ids, sampling, req_id)


class PDRouter(Router):
    """Disaggregated serving: a prefill engine computes the prompt and answers where its KV
    lives; a decode engine loads that KV over NIXL and streams the tokens. One request id
    across both, round robin over each kind."""

    def __init__(
        self, prefill: Sequence[Engine], decode: Sequence[Engine], migration: MigrationPolicy | None = None
    ) -> None:
        if not prefill or not decode:
            raise ValueError("PD serving needs at least one prefill and one decode engine")
        super().__init__([*prefill, *decode], migration or MigrationPolicy())
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)

    async def _attempt(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        prefill = next(self._prefill).client
        handed_over: RequestOutput | None = None
        async for out in prefill.generate(prompt_ids, sampling, req_id, do_remote_decode=True):
            handed_over = out
        if handed_over is None or handed_over.kv_transfer_params is None:
            yield handed_over or RequestOutput(req_id, [], None, "error", error="prefill engine gave no answer")
            return
        # From here the decode engine owns the prefill engine's blocks: it READs them, or tells
        # the prefill side it never will (an abort, a refusal, a local hit), or the lease ends.
        # Freeing them from here could race a READ the decode engine has already posted.
        decode = next(self._decode).client
        # The prompt's logprobs came with the hand-over (the prefill engine ran its forward):
        # they go out with the first token, and the decode side computes none.
        prompt_logprobs = handed_over.prompt_logprobs
        if sampling.prompt_logprobs is not None:
            sampling = replace(sampling, prompt_logprobs=None)
        try:
            async with aclosing(
                decode.generate(prompt_ids, sampling, req_id, kv_transfer_params=handed_over.kv_transfer_params)
            ) as stream:
                async for out in stream:
                    if prompt_logprobs is not None:
                        out, prompt_logprobs = replace(out, prompt_logprobs=prompt_logprobs), None
                    yield out
        except EngineLostError:
            # Unless the decode engine is gone: a READ it posted can still only read the blocks,
            # for a request that is lost anyway, so they are freed now instead of at the lease's
            # end (an abort of blocks already read is a no-op). A dead prefill engine needs none.
            with contextlib.suppress(Exception):
                await prefill.abort(req_id)
            raise
