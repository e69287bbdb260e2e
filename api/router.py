"""Which engine serves a request. Routes only call `Router.generate`, so the choice (a policy over
colocated engines, or a decode engine, then a prefill engine unless the prompt is computed where
it decodes, under PD: api/routing/) can change without touching them."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from actors.client import ActorSlot, EngineCalls, EngineClient, EngineLostError
from api.migration import MigrationPolicy, resumable
from api.routing.fleet import DEFAULT_POLL_INTERVAL_S, Fleet, FleetRole
from api.routing.plan import route
from api.routing.policies import Policy, RoundRobin, expected_hit, make_policy
from api.routing.prefix import PromptBlocks
from engine.config import Config
from engine.messages import EngineStats, RequestOutput, SamplingParams
from engine.summary import EngineSummary


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine as the ingress sees it: a name (the `engine` label of its metrics), a client
    for its requests, its stats, and its routing summary (engine/summary.py). A remote engine's
    actor can be replaced (`rebind`)."""

    name: str
    client: EngineClient
    stats: Callable[[], Awaitable[EngineStats]]
    summary: Callable[[int | None], Awaitable[EngineSummary]]
    slot: ActorSlot | None = None

    @classmethod
    def remote(cls, name: str, handle: Any) -> Engine:
        """An `EngineActor` reached over Ray."""
        slot = ActorSlot(handle)

        async def stats() -> EngineStats:
            return await slot.handle.stats.remote()

        async def summary(since_version: int | None) -> EngineSummary:
            return await slot.handle.routing_summary.remote(since_version)

        return cls(name, EngineClient(EngineCalls.remote(slot)), stats, summary, slot)

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

        async def summary(since_version: int | None) -> EngineSummary:
            return core.routing_summary(since_version)

        return cls(name, EngineClient(EngineCalls.local(core)), stats, summary)


class Router(ABC):
    """Routes over a `Fleet`, which may change while requests run (engines added, removed,
    drained, or rebound to a replacement actor); a policy picks among the fleet's engines as it
    is at each decision. Engine summaries are polled in the background from the first request."""

    def __init__(
        self, fleet: Fleet, migration: MigrationPolicy, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    ) -> None:
        if not fleet.engines:
            raise ValueError("a router needs at least one engine")
        self.fleet = fleet
        self.migration = migration
        self.poll_interval_s = poll_interval_s
        self.num_resumed = 0  # tries after a lost engine (`raypd_requests_resumed_total`)
        self.decisions: dict[tuple[str, str], int] = {}  # PD: (decision, reason) -> requests
        self._poller: asyncio.Task[None] | None = None

    @property
    def engines(self) -> list[Engine]:
        return self.fleet.engines

    def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until one carries a finish reason; leaving early aborts it. A
        request whose engine is lost goes on on another one (api/migration.py)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self.fleet.run(self.poll_interval_s))
        return resumable(self._attempt, prompt_ids, sampling, req_id, self.migration, self._resumed)

    async def refresh(self, timeout_s: float = 10.0) -> None:
        """Poll every engine's summary now (tests; the background poll does it otherwise)."""
        await self.fleet.poll(timeout_s)

    def _resumed(self) -> None:
        self.num_resumed += 1

    @abstractmethod
    def _attempt(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """One try on the engine(s) the router picks; raises EngineLostError if one goes away."""

    async def _stream(
        self, name: str, prompt_ids: list[int], sampling: SamplingParams, req_id: str, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of one engine's call; an engine lost under it is left out of the next
        decisions until a poll hears from it again. One removed from the fleet since it was chosen
        (drained and stopped by the autoscaler, serve/controller.py) is lost too: the request
        resumes on another engine."""
        try:
            engine = self.fleet.engine(name)
        except KeyError:
            raise EngineLostError(f"engine {name} has left the fleet") from None
        try:
            async with aclosing(engine.client.generate(prompt_ids, sampling, req_id, **kwargs)) as s:
                async for out in s:
                    yield out
        except EngineLostError:
            self.fleet.lost(name)
            raise

    async def stats(self, timeout_s: float) -> dict[str, EngineStats]:
        """Each engine's stats; one that does not answer within `timeout_s` is left out, so a
        stuck engine cannot hang a metrics scrape."""

        async def one(engine: Engine) -> EngineStats | None:
            try:
                return await asyncio.wait_for(engine.stats(), timeout_s)
            except Exception:
                return None

        engines = self.engines
        results = await asyncio.gather(*(one(e) for e in engines))
        return {e.name: s for e, s in zip(engines, results, strict=True) if s is not None}

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await asyncio.gather(*(e.client.close() for e in self.engines))


class ColocatedRouter(Router):
    """Colocated engines, each request on the one the policy picks."""

    def __init__(
        self, engines: Sequence[Engine], migration: MigrationPolicy | None = None, policy: Policy | None = None
    ) -> None:
        super().__init__(Fleet((e, "colocated") for e in engines), migration or MigrationPolicy())
        self.policy = policy or RoundRobin()

    def _attempt(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        prompt = PromptBlocks(prompt_ids)
        chosen = self.policy.choose(self.fleet.candidates("colocated"), prompt, sampling.max_tokens)
        self.fleet.dispatched(chosen.name, len(prompt_ids) - expected_hit(chosen, prompt))
        return self._stream(chosen.name, prompt_ids, sampling, req_id)


class RoundRobinRouter(ColocatedRouter):
    """Colocated engines, each taking every n-th request (in-process tests and tools)."""

    def __init__(self, engines: Sequence[Engine], migration: MigrationPolicy | None = None) -> None:
        super().__init__(engines, migration, RoundRobin())


class PDRouter(Router):
    """Disaggregated serving: the policy picks a decode engine; unless the prompt is computed
    there (conditional disaggregation, api/routing/disagg.py), it picks a prefill engine too,
    which computes the prompt and answers where its KV lives, and the decode engine loads that
    KV over NIXL and streams the tokens. One request id across both."""

    def __init__(
        self,
        prefill: Sequence[Engine],
        decode: Sequence[Engine],
        migration: MigrationPolicy | None = None,
        policy: Policy | None = None,
        min_prefill_tokens: int = 0,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("PD serving needs at least one prefill and one decode engine")
        roles: list[tuple[Engine, FleetRole]] = [*((e, "prefill") for e in prefill), *((e, "decode") for e in decode)]
        super().__init__(Fleet(roles), migration or MigrationPolicy())
        self.policy = policy or RoundRobin()
        self.min_prefill_tokens = min_prefill_tokens

    async def _attempt(
        self, prompt_ids: list[int], sampling: SamplingParams, req_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        plan = route(
            self.policy,
            self.fleet.candidates("decode"),
            self.fleet.candidates("prefill"),
            PromptBlocks(prompt_ids),
            sampling.max_tokens,
            self.min_prefill_tokens,
        )
        decode, prefill = plan.decode, plan.prefill
        key = (plan.disagg.decision, plan.disagg.reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if prefill is None:
            self.fleet.dispatched(decode.name, plan.disagg.uncached_tokens)
            async with aclosing(self._stream(decode.name, prompt_ids, sampling, req_id)) as stream:
                async for out in stream:
                    yield out
            return
        self.fleet.dispatched(prefill.name, len(prompt_ids) - plan.prefill_hit)
        handed_over: RequestOutput | None = None
        async with aclosing(self._stream(prefill.name, prompt_ids, sampling, req_id, do_remote_decode=True)) as s:
            async for out in s:
                handed_over = out
        if handed_over is None or handed_over.kv_transfer_params is None:
            yield handed_over or RequestOutput(req_id, [], None, "error", error="prefill engine gave no answer")
            return
        # From here the decode engine owns the prefill engine's blocks: it READs them, or tells
        # the prefill side it never will (an abort, a refusal, a local hit), or the lease ends.
        # Freeing them from here could race a READ the decode engine has already posted.
        self.fleet.dispatched(decode.name, 0)
        # The prompt's logprobs came with the hand-over (the prefill engine ran its forward):
        # they go out with the first token, and the decode side computes none.
        prompt_logprobs = handed_over.prompt_logprobs
        if sampling.prompt_logprobs is not None:
            sampling = replace(sampling, prompt_logprobs=None)
        params = handed_over.kv_transfer_params
        try:
            async with aclosing(
                self._stream(decode.name, prompt_ids, sampling, req_id, kv_transfer_params=params)
            ) as s:
                async for out in s:
                    if prompt_logprobs is not None:
                        out, prompt_logprobs = replace(out, prompt_logprobs=prompt_logprobs), None
                    yield out
        except EngineLostError:
            # Unless the decode engine is gone: a READ it posted can still only read the blocks,
            # for a request that is lost anyway, so they are freed now instead of at the lease's
            # end (an abort of blocks already read is a no-op). A dead prefill engine needs none.
            with contextlib.suppress(Exception):
                await self.fleet.engine(prefill.name).client.abort(req_id)
            raise


def make_router(cfg: Config, prefill: Sequence[Engine], decode: Sequence[Engine], migration: MigrationPolicy) -> Router:
    """The router `cfg` asks for: PD when there are prefill engines, else colocated ones (the
    "decode" list), choosing by `cfg.router`."""
    policy = make_policy(cfg.router)
    if prefill:
        return PDRouter(prefill, decode, migration, policy, cfg.pd_min_prefill_tokens)
    return ColocatedRouter(decode, migration, policy)
