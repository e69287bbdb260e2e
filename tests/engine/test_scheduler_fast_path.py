"""The decode fast paths give what the general paths give: `KVCacheManager.covered` lets the
scheduler skip `allocate_slots` for a step within a request's own blocks, a plain request's
token skips the full stop check (`StopChecker.plain_limits`), a step that completes no block
publishes nothing to the prefix cache (`KVCacheManager.has_new_full_block`), and
`request_output` builds a `RequestOutput` without the frozen dataclass's `__init__`."""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Mapping

import pytest

from engine.messages import ModelRunnerOutput, RequestOutput, SamplingParams, SchedulerOutput, request_output
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.cache_group import CacheGroup
from kv.kv_cache_manager import KVCacheManager
from tests.engine.fake_worker import FakeWorker

HYBRID = [CacheGroup("attention", (1, 4)), CacheGroup("mamba", (0, 3))]
DENSE = [CacheGroup("attention", (0, 1))]


class _GeneralPathKV(KVCacheManager):
    """Never answers from the covered-tokens shortcut: every step goes through the whole of
    `allocate_slots`, and every step's computed blocks are offered to the prefix cache, as
    before the fast paths existed."""

    @property
    def covered(self) -> Mapping[str, int]:
        return {}

    def fits(self, req_id: str, num_tokens_total: int) -> bool:
        return False

    def has_new_full_block(self, req_id: str, num_computed_tokens: int) -> bool:
        return True


class _GeneralStopChecker(StopChecker):
    """Every token through `check`."""

    def plain_limits(self, req: Request) -> tuple[int, int] | None:
        return None


def _trace(general: bool, groups, num_blocks: int, async_depth: int, seed: int, prefix: bool = False):
    """Every step's `SchedulerOutput` and the outputs it produced, over a random workload on a
    tight pool (preemptions, chunked prefill, eos, length and context stops, shared prefixes
    when `prefix`), with `async_depth` steps in flight; `general` turns the fast paths off."""
    rng = random.Random(seed)
    kv_cls, stop_cls = (_GeneralPathKV, _GeneralStopChecker) if general else (KVCacheManager, StopChecker)
    kv = kv_cls(groups, num_blocks, 4, enable_prefix_caching=prefix)
    # The stop checker's context is shorter than what admission allows: context stops happen.
    sched = Scheduler(SchedulerConfig(24, 8, 64), kv, stop_cls(None, 48))
    shared = [rng.randrange(1, 50) for _ in range(9)]
    for i in range(24):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
        if prefix and rng.random() < 0.5:
            prompt = shared + prompt
        sp = SamplingParams(max_tokens=rng.randrange(1, 64 - len(prompt)), ignore_eos=rng.random() < 0.5)
        sched.add_request(Request(f"r{i}", prompt, sp, eos_token_id=7))
    worker = FakeWorker(prefix_sharing=prefix)
    trace: list[tuple[SchedulerOutput, list[RequestOutput]]] = []
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for _ in range(2000):
        if not sched.has_work() and not in_flight:
            break
        out = sched.schedule() if len(in_flight) < async_depth else None
        if out is not None:
            in_flight.append((out, worker.run(out)))
        if out is None or len(in_flight) == async_depth:
            done, result = in_flight.popleft()
            trace.append((done, sched.update_from_output(done, result)))
    else:
        raise AssertionError("the workload did not finish")
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    return trace, sched.num_preemptions


@pytest.mark.parametrize(
    ("groups", "prefix"), [(HYBRID, False), (DENSE, False), (DENSE, True)], ids=["hybrid", "dense", "dense-prefix"]
)
@pytest.mark.parametrize("async_depth", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_fast_path_schedules_exactly_as_the_general_path(groups, prefix, async_depth, seed):
    fast, fast_preemptions = _trace(False, groups, 24, async_depth, seed, prefix)
    general, general_preemptions = _trace(True, groups, 24, async_depth, seed, prefix)
    assert fast == general
    assert fast_preemptions == general_preemptions > 0  # the pool really was tight
    assert "length" in {o.finish_reason for _, batch in fast for o in batch}
    if prefix:
        assert any(new.num_computed_tokens for out, _ in fast for new in out.new_reqs)  # prefix hits


def test_request_output_is_the_constructors_object():
    args = ("r1", [5, 6], [-0.5, -1.0], "stop", 12, 2, None)
    built = request_output(*args)
    assert built == RequestOutput(*args)
    assert [getattr(built, f.name) for f in dataclasses.fields(RequestOutput)] == [*args, None, None, None]
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.finish_reason = None  # type: ignore[misc]
