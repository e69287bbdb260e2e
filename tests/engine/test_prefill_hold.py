"""Async scheduling waits behind a long prompt step (docs/design.md §3): a request that arrives
while it runs joins the very next step. The engine runs on a clock the test moves, with an
executor whose steps end when the test says, so each step's length is chosen, not raced."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from engine.core import EngineCore, PollPause
from engine.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.kv_cache_manager import KVCacheManager
from tests.engine.test_pd import BS, DENSE

PROMPT = list(range(2, 11))  # 9 tokens: 8 of them beyond the one a decode step computes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Steps:
    """An executor whose steps end one at a time when the test ends them, each sampling token 1
    for every request it ran."""

    def __init__(self) -> None:
        self.sent: list[SchedulerOutput] = []
        self._pending: list[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = []

    def __call__(self, out: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        fut: Future[ModelRunnerOutput] = Future()
        self.sent.append(out)
        self._pending.append((out, fut))
        return asyncio.wrap_future(fut)

    def end_first(self) -> None:
        out, fut = self._pending.pop(0)
        fut.set_result(ModelRunnerOutput(out.step_id, dict.fromkeys(out.num_scheduled_tokens, 1)))

    @property
    def in_flight(self) -> int:
        return len(self._pending)


async def settle() -> None:
    """Let the engine's loop run until it waits on a step (it never waits on time here)."""
    for _ in range(50):
        await asyncio.sleep(0)


def engine(hold_s: float | None) -> tuple[EngineCore, Steps, Clock]:
    kv = KVCacheManager(DENSE, 40, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(64, 8, 256), kv, StopChecker(None, 256), None)
    steps, clock = Steps(), Clock()
    core = EngineCore(sched, [steps], True, None, prefill_hold_s=hold_s, clock=clock)
    return core, steps, clock


def add(core: EngineCore, req_id: str) -> None:
    core.add_request(req_id, PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))


async def warm(core: EngineCore, steps: Steps, clock: Clock, step_s: float) -> None:
    """Serve one request alone whose prompt step takes `step_s`: the engine's estimate."""
    add(core, "warm")
    await settle()
    while steps.in_flight:
        clock.now += step_s if steps.sent[-steps.in_flight].num_scheduled_tokens.get("warm", 0) > 1 else 0.001
        steps.end_first()
        await settle()
    await core.wait_idle()
    # Its last step planned no tokens, after which the loop pauses for at most the longest
    # poll pause; that timer was set before this one, so it fires first.
    await asyncio.sleep(2 * PollPause().longest)


def test_with_no_estimate_a_prompt_step_is_waited_for_and_arrivals_join_the_next():
    async def main() -> None:
        core, steps, clock = engine(0.1)
        add(core, "a")
        await settle()
        assert steps.in_flight == 1, "a step was planned behind the first prompt step"
        add(core, "b")
        add(core, "c")
        clock.now += 0.5
        steps.end_first()
        await settle()
        assert steps.sent[1].num_scheduled_tokens == {"a": 1, "b": 9, "c": 9}
        await core.close()

    asyncio.run(main())


def test_a_prompt_step_expected_to_be_long_is_waited_for():
    async def main() -> None:
        core, steps, clock = engine(0.1)
        await warm(core, steps, clock, step_s=0.9)  # 0.1 s a prompt token
        sent = len(steps.sent)
        add(core, "a")
        await settle()
        assert steps.in_flight == 1
        add(core, "b")
        clock.now += 0.9
        steps.end_first()
        await settle()
        assert steps.sent[sent + 1].num_scheduled_tokens == {"a": 1, "b": 9}
        await core.close()

    asyncio.run(main())


def test_a_short_prompt_step_and_decode_steps_are_planned_ahead():
    async def main() -> None:
        core, steps, clock = engine(0.1)
        await warm(core, steps, clock, step_s=0.008)  # 1 ms a prompt token: 8 ms a step
        sent = len(steps.sent)
        add(core, "a")
        await settle()
        assert steps.in_flight == 2, "no step planned behind a short prompt step"
        assert steps.sent[sent + 1].num_scheduled_tokens == {"a": 1}
        add(core, "b")  # too late for the step already planned
        clock.now += 0.008
        steps.end_first()
        await settle()
        assert steps.in_flight == 2  # behind a's decode step, the next one is planned at once
        assert steps.sent[sent + 2].num_scheduled_tokens == {"a": 1, "b": 9}
        await core.close()

    asyncio.run(main())


def test_without_a_hold_every_step_is_planned_ahead():
    async def main() -> None:
        core, steps, clock = engine(None)
        add(core, "a")
        await settle()
        assert steps.in_flight == 2
        add(core, "b")
        clock.now += 10.0
        steps.end_first()
        await settle()
        assert steps.sent[1].num_scheduled_tokens == {"a": 1}
        assert steps.sent[2].num_scheduled_tokens == {"a": 1, "b": 9}
        await core.close()

    asyncio.run(main())
