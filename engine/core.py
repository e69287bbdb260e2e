"""The engine loop: schedule a step, hand it to every worker, apply the result.

With async scheduling two steps are in flight: step N+1 is scheduled and submitted while
step N runs, so the workers never wait for the scheduler, except behind a long prompt step
(`prefill_hold_s`): requests that arrive while it runs join the step after it, not one later.

The loop is asyncio so that one Ray actor can run it and still take requests and aborts;
workers are reached through `StepExecutor`s (an in-process `Worker`, or a Ray worker actor),
so the same code runs in one process for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from engine.messages import (
    ENGINE_FAILURE,
    EngineFailedError,
    EngineOverloadedError,
    EngineStats,
    InvalidRequestError,
    ModelRunnerOutput,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from engine.pd import STAT_NAMES
from engine.phases import RequestPhases
from engine.rank_merge import RankMerger
from engine.request import Request
from engine.scheduler import Scheduler
from engine.summary import EngineSummary, summarize
from kv.nixl.transfer_params import KVTransferParams

log = logging.getLogger(__name__)

# Called synchronously when a step is dispatched (so steps reach each worker in order);
# the awaitable resolves with the worker's result.
_STALL_RECHECK_S = 0.05

StepExecutor = Callable[[SchedulerOutput], Awaitable[ModelRunnerOutput]]


@dataclass(slots=True)
class PollPause:
    """How long the engine waits after a step that computed no token (it only polled KV
    transfers) before the next: `first` after a step that computed, doubling with each
    polling step in a row up to `longest`. A decode engine's load of a short prompt lands in a
    millisecond or two; a fixed 2 ms pause made it wait for the next poll, where the doubling
    looks again soon and still bounds the round trips a long transfer costs (docs/design.md
    §9)."""

    first: float = 0.00025
    longest: float = 0.002
    _next: float = field(init=False)

    def __post_init__(self) -> None:
        self._next = self.first

    def reset(self) -> None:
        """A step computed some token: the next polling step starts short again."""
        self._next = self.first

    def take(self) -> float:
        """The pause after this polling step."""
        pause = self._next
        self._next = min(2 * pause, self.longest)
        return pause


def prompt_tokens(out: SchedulerOutput) -> int:
    """The tokens a step computes beyond one per request: its prompt chunks."""
    return sum(n - 1 for n in out.num_scheduled_tokens.values() if n > 1)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executors: Sequence[StepExecutor],
        async_scheduling: bool,
        eos_token_id: int | None,
        max_waiting: int = 1 << 30,
        prefill_hold_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`prefill_hold_s`: plan no step behind one whose prompt tokens are expected to take this
        long or longer (None: always plan ahead); `clock` times the steps for that estimate."""
        if not executors:
            raise ValueError("an engine needs at least one worker")
        if scheduler.pd is not None and scheduler.pd.config.tp_size != len(executors):
            raise ValueError(f"a PD engine of TP size {scheduler.pd.config.tp_size} given {len(executors)} workers")
        self.scheduler = scheduler
        self.executors = list(executors)
        # One executor per tensor-parallel rank: their results become one (engine/rank_merge.py).
        self.merger = RankMerger(len(self.executors))
        self.depth = 2 if async_scheduling else 1
        self.eos_token_id = eos_token_id
        self.max_waiting = max_waiting
        self.prefill_hold_s = prefill_hold_s
        self._clock = clock
        # Seconds per prompt token of the last step that computed some; None until one has.
        self._s_per_prompt_token: float | None = None
        self._last_done = clock()
        self._outputs: list[OutputBatch] = []
        self._has_outputs = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Each step in flight with the time it was dispatched.
        self._in_flight: deque[tuple[SchedulerOutput, asyncio.Future[list[ModelRunnerOutput]], float]] = deque()
        self._failure: BaseException | None = None
        self.num_steps = 0
        self.phases = RequestPhases()
        self.poll_pause = PollPause()

    # -- client side ------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        do_remote_decode: bool = False,
    ) -> None:
        """Queue a request; raises InvalidRequestError for one the engine cannot serve.

        `do_remote_decode` (prefill engine): compute the prompt and hand its KV over
        (engine/pd.py). `kv_transfer_params` (decode engine): load that KV instead of computing
        it. They come from another engine through the ingress, so they are validated here, once.
        """
        if self._failure is not None:
            raise EngineFailedError(f"engine failed: {self._failure!r}")
        params = kv_transfer_params
        if params is not None:
            # Before the refusals below notify the prefill side: a malformed agent name or
            # request id cannot name whom to notify.
            try:
                params.validate()
            except ValueError as e:
                raise InvalidRequestError(str(e), param="kv_transfer_params") from None
        try:
            sampling.validate()
            if len(self.scheduler.waiting) >= self.max_waiting:
                raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are waiting; retry later")
            prompt = list(prompt_token_ids)
            scored_tail: tuple[int, ...] = ()
            if do_remote_decode:
                self.scheduler.check_length(len(prompt), sampling.max_tokens)  # before any prefill work
                split = self.scheduler.disaggregation().prefill_request(req_id, prompt, sampling)
                if isinstance(split, RequestOutput):
                    self._publish(OutputBatch(others=[split]))
                    return
                if sampling.prompt_logprobs is not None:
                    scored_tail = tuple(prompt[len(split[0]) :])  # the decode side computes it
                prompt, sampling = split
            self.scheduler.add_request(
                Request(
                    req_id,
                    prompt,
                    sampling,
                    self.eos_token_id,
                    kv_transfer_params=params,
                    do_remote_decode=do_remote_decode,
                    scored_tail=scored_tail,
                )
            )
            self.phases.arrived(req_id)
        except (InvalidRequestError, EngineOverloadedError) as e:
            duplicate = getattr(e, "param", None) == "request_id"  # the live request's KV is not ours to drop
            if params is not None and self.scheduler.pd is not None and not duplicate:
                self.scheduler.pd.refused(params)  # so the prefill side frees now
                self._ensure_running()
                self._wake.set()
            raise
        self._ensure_running()
        self._wake.set()

    def abort(self, req_id: str) -> None:
        out = self.scheduler.abort(req_id)
        if out is not None:
            self._publish(OutputBatch(others=[out]))
        self._wake.set()

    async def get_outputs(self, timeout: float | None = None) -> list[OutputBatch]:
        """Everything produced since the last call: one batch per step for all requests, to be
        applied in order."""
        if not self._outputs:
            try:
                await asyncio.wait_for(self._has_outputs.wait(), timeout)
            except TimeoutError:
                return []
        out, self._outputs = self._outputs, []
        self._has_outputs.clear()
        return out

    def stats(self) -> EngineStats:
        """Raises once the loop has failed, so health checks see a dead engine."""
        if self._failure is not None:
            raise EngineFailedError(f"engine failed: {self._failure!r}")
        s = self.scheduler
        return EngineStats(
            len(s.running),
            len(s.waiting),
            s.kv.num_blocks,
            s.kv.num_free_blocks,
            s.blocks_zeroed,
            s.blocks_skipped,
            {
                "steps": self.num_steps,
                "preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                **(s.pd.stats() if s.pd is not None else dict.fromkeys(STAT_NAMES, 0)),
                "rank_merge_partial": self.merger.num_partial,
                "phases": self.phases.snapshot(),
            },
        )

    def routing_summary(self, since_version: int | None = None) -> EngineSummary:
        """The load and cache digest the routers choose by (engine/summary.py); raises like
        `stats` once the loop has failed, so a router stops choosing a dead engine."""
        if self._failure is not None:
            raise EngineFailedError(f"engine failed: {self._failure!r}")
        return summarize(self.scheduler, since_version)

    async def wait_idle(self) -> None:
        """Until no request is left and every fenced block is back in the pool."""
        while self.scheduler.has_work() or self._in_flight:
            if self._failure is not None:
                raise EngineFailedError(f"engine failed: {self._failure!r}")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -- loop -------------------------------------------------------------------------

    def _publish(self, batch: OutputBatch) -> None:
        if batch:
            self.phases.outputs(batch)
            self._outputs.append(batch)
            self._has_outputs.set()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a worker died or a step failed: fail every request loudly
            log.exception("engine loop failed")
            self._failure = e
            self._in_flight.clear()
            self._fail_all(repr(e))

    async def _loop(self) -> None:
        flight = self._in_flight
        while True:
            self._wake.clear()
            if len(flight) < self.depth and self.scheduler.has_work() and not self._hold():
                out = self.scheduler.schedule()
                if ended := self.scheduler.take_outputs():
                    self._publish(OutputBatch(others=ended))
                if out is not None:
                    self.phases.scheduled(out.num_scheduled_tokens)
                    fut = asyncio.gather(*(ex(out) for ex in self.executors))
                    flight.append((out, fut, self._clock()))
                    continue
            if flight:
                out, fut, dispatched = flight[0]
                results = await fut
                self._timed(out, dispatched)
                # Popped only once applied: until then `wait_idle` must see the step in flight.
                flight.popleft()
                self.num_steps += 1
                self._publish(self.scheduler.update_from_output(out, self.merger.merge(results)))
                if out.num_scheduled_tokens:
                    self.poll_pause.reset()
                else:
                    await asyncio.sleep(self.poll_pause.take())  # only polling transfers: do not spin
                continue
            if not self.scheduler.has_work():
                await self._wake.wait()
                continue
            # Work that cannot run yet with no step in flight (it waits on time: a lease, a
            # transfer) must still be looked at again without a wake-up.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _STALL_RECHECK_S)

    def _hold(self) -> bool:
        """Whether to wait for the step in flight before planning the next one.

        Planning ahead saves the workers one round trip to the engine a step, but a step planned
        behind a long one is fixed before that one ends: requests that arrive meanwhile wait a
        whole step more. Behind a prompt step expected to take `prefill_hold_s` or longer (with
        no estimate yet, any prompt step) the round trip is the smaller cost, so the engine waits.
        """
        if not self._in_flight or self.prefill_hold_s is None:
            return False
        n = prompt_tokens(self._in_flight[-1][0])
        if not n:
            return False
        per = self._s_per_prompt_token
        return per is None or n * per >= self.prefill_hold_s

    def _timed(self, out: SchedulerOutput, dispatched: float) -> None:
        """Learn the time per prompt token from a step that ended: it ran from its dispatch, or
        from the end of the step before it if it was queued behind that one."""
        done = self._clock()
        started = max(dispatched, self._last_done)
        self._last_done = done
        if n := prompt_tokens(out):
            self._s_per_prompt_token = (done - started) / n

    def _fail_all(self, why: str) -> None:
        failed = []
        for req_id in list(self.scheduler.requests):
            out = self.scheduler.abort(req_id)
            if out is not None:
                failed.append(
                    RequestOutput(
                        req_id,
                        out.new_token_ids,
                        None,
                        "error",
                        out.num_prompt_tokens,
                        out.num_output_tokens,
                        error=ENGINE_FAILURE + why,
                    )
                )
        self._publish(OutputBatch(others=failed))
