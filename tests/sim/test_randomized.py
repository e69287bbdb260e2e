"""The randomized suite (issue 8): seeded workloads through the real engine, scheduler and KV
manager, with content-tracking simulated workers and a simulated NIXL (tests/sim/).

Every shape runs for 30 seeds in every `make test` (about 60 s of one core for the whole file),
and for `_LONG_SEEDS` more under the `sim_long` marker (`make test-sim-long`). A failure prints,
for each problem, the shape, seed, request and, where it applies, step, block and expected vs
found content.
"""

from __future__ import annotations

import pytest

from tests.sim.harness import run_shape
from tests.sim.workload import SHAPES, Shape

_SEEDS = 30
_LONG_SEEDS = 120
_FIX_OFF_SHAPES = [s for s in SHAPES.values() if s.pd and s.model != "dense"]


def _seeds() -> list[object]:
    return [
        seed if seed < _SEEDS else pytest.param(seed, marks=pytest.mark.sim_long)
        for seed in range(_SEEDS + _LONG_SEEDS)
    ]


@pytest.mark.parametrize("seed", _seeds())
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=lambda s: s.name)
def test_randomized(shape: Shape, seed: int) -> None:
    report = run_shape(shape, seed)
    assert report.ok, f"{len(report.problems)} problems, stats {report.stats}\n{report.summary()}"


@pytest.mark.parametrize("seed", _seeds())
@pytest.mark.parametrize("shape", _FIX_OFF_SHAPES, ids=lambda s: s.name)
def test_fix_off_is_caught(shape: Shape, seed: int) -> None:
    """With `debug_zero_loaded_blocks` the decode worker zeroes the blocks its READ fills; a
    READ that lands before its step's queued zeroing (a run's first READ always does) is
    wiped, and the forward reads zeros where the prompt's K/V should be. Dense shapes are
    not here: a dense model never zeroes, so the switch changes nothing for them."""
    report = run_shape(shape, seed, debug_zero_loaded_blocks=True)
    assert report.stats.get("landed_before_zeroing", 0) >= 1
    assert report.stats.get("zeroed_reads", 0) >= 1, f"fix off not caught: stats {report.stats}"
    assert "WRONG" in report.kinds(), "a wiped load must also show in the tokens"


def test_tp_loads_failing_on_one_rank_are_failed_loads() -> None:
    """A load that fails on one decode rank and lands on the other is a failed load for the
    scheduler, recomputed, whatever the other rank's bytes: runs see such loads, count each
    failed load once, and still give the colocated outputs."""
    shape = SHAPES["dense_pd_prefix_fail_recompute_tp12"]
    for seed in range(3):
        report = run_shape(shape, seed)
        assert report.ok, f"{len(report.problems)} problems, stats {report.stats}\n{report.summary()}"
        assert report.stats["one_rank_failed"] > 0
        assert report.stats["decode_failed_loads"] == report.stats["failed_load_reqs"]


def test_hybrid_prefix_shapes_hit_locally_on_every_engine() -> None:
    """The hybrid prefix-caching shapes do take hits where they claim to: the colocated
    engine, the prefill engine on its own cache, and the decode engine on its own cache
    before loading the rest (docs/design.md §21); the outputs stay the colocated ones."""
    totals: dict[str, int] = {}
    for seed in range(3):
        report = run_shape(SHAPES["hybrid_pd_prefix"], seed)
        assert report.ok, f"{len(report.problems)} problems, stats {report.stats}\n{report.summary()}"
        for key in ("colocated_prefix_hits", "prefill_prefix_hits", "decode_prefix_hits", "loads"):
            totals[key] = totals.get(key, 0) + report.stats[key]
    assert all(totals.values()), totals
