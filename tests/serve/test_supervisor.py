"""The engine supervisor's decision (serve/engines.py): which answers to its `stats` probe make
it replace an engine. The engines here are stand-ins whose probe answers as told; what is under
test is the decision, not Ray (tests/api/test_faults_http.py and tests/pd/test_pd_bad_days.py
kill and replace real engine actors)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError, TaskCancelledError

from engine.config import Config
from engine.messages import EngineFailedError, EngineStats
from serve.engines import EngineSupervisor, engine_dead

PREFILL, DECODE = "raypd-prefill-0", "raypd-decode-0"


def _stats() -> EngineStats:
    return EngineStats(0, 0, 8, 8, 0, 0, {})


class _Probe:
    """`handle.stats.remote()`: awaitable, answering with `answer` (an exception is raised), after
    `delay_s`."""

    def __init__(self, answer: Any, delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1
        return self._answer()

    async def _answer(self) -> Any:
        await asyncio.sleep(self.delay_s)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class _Engine:
    def __init__(self, answer: Any = None, delay_s: float = 0.0) -> None:
        self.stats = _Probe(_stats() if answer is None else answer, delay_s)


class _Supervisor(EngineSupervisor):
    """Records what it would replace instead of creating actors."""

    def __init__(self, handles: dict[str, Any], probe_timeout_s: float = 0.2) -> None:
        super().__init__(
            Config(prefill=1, decode=1), handles, lambda *_: None, interval_s=0.01, probe_timeout_s=probe_timeout_s
        )
        self.replaced: list[str] = []

    async def replace(self, name: str) -> None:
        self.replaced.append(name)
        self.handles[name] = _Engine()  # the replacement answers


def _in_task(error: BaseException) -> BaseException:
    """`error` raised inside an actor method, as the caller receives it."""
    return RayTaskError("stats", "Traceback: ...", error).as_instanceof_cause()


def _unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("The actor is temporarily unavailable: RpcError: failed to connect", None)


@pytest.mark.parametrize(
    ("error", "dead"),
    [
        (ActorDiedError(), True),
        (EngineFailedError("engine failed: boom"), True),
        (_in_task(EngineFailedError("engine failed: boom")), True),  # the loop failed: stats() raises it
        (_in_task(ActorDiedError()), True),  # the engine's worker died under its stats() call
        (_unavailable(), False),  # not reached this time; Ray does not know it dead
        (_in_task(_unavailable()), False),
        (TaskCancelledError(), False),
        (TimeoutError(), False),
    ],
    ids=[
        "actor-died",
        "loop-failed",
        "loop-failed-via-ray",
        "worker-died",
        "unavailable",
        "worker-unavailable",
        "cancelled",
        "timeout",
    ],
)
def test_only_death_or_a_failed_loop_is_death(error, dead):
    assert engine_dead(error) is dead


def _run(sup: _Supervisor, rounds: int) -> None:
    async def main() -> None:
        task = asyncio.ensure_future(sup.run())
        while min(h.stats.calls for h in sup.handles.values()) < rounds and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_engine_that_ray_cannot_reach_for_now_is_probed_again_not_replaced():
    """The flaw this pins: any RayActorError counted as death, so an ActorUnavailableError (an RPC
    that failed while the actor lived) had a busy engine killed, and the requests it held had
    to find another engine before their migration deadline (a 503 "engine restarting" if not)."""
    sup = _Supervisor({PREFILL: _Engine(_unavailable()), DECODE: _Engine()})
    _run(sup, rounds=5)
    assert sup.replaced == []


def test_a_busy_engine_whose_probe_times_out_is_not_replaced():
    sup = _Supervisor({PREFILL: _Engine(delay_s=1.0), DECODE: _Engine()}, probe_timeout_s=0.05)
    _run(sup, rounds=3)
    assert sup.replaced == []


@pytest.mark.parametrize("error", [ActorDiedError(), _in_task(EngineFailedError("engine failed: boom"))])
def test_a_dead_engine_is_replaced_once(error):
    sup = _Supervisor({PREFILL: _Engine(), DECODE: _Engine(error)})
    _run(sup, rounds=5)
    assert sup.replaced == [DECODE]
