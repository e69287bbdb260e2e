"""The race the fix closes, made visible, and KV load failures under both policies."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.engine.test_core import alone, workload
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import DEVICE, run_pd


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    save_hf_model("nemotron_h", path)
    return str(path)


@pytest.fixture(scope="module")
def reference(hybrid):
    reqs = workload(24, seed=5)
    return reqs, alone(hybrid, reqs)


def base(path: str, **kw) -> Config:
    return Config(
        model=path,
        dtype="float32",
        device=DEVICE,
        block_size=4,
        num_kv_blocks=600,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        worker_threads=1,
        seed=2,
        **kw,
    )


@pytest.mark.parametrize("debug_zero", [False, True])
def test_lagging_stream_wipes_loaded_kv_only_without_the_fix(ray_cluster, hybrid, reference, debug_zero):
    """The compute stream lags, so each step's zeroing runs after its READs have landed."""
    reqs, want = reference
    got, stats = run_pd(base(hybrid, debug_stream_delay_ms=30, debug_zero_loaded_blocks=debug_zero), reqs)
    wrong = sum(t != w for (t, _, _), w in zip(got, want))
    if debug_zero:
        assert stats.blocks_skipped == 0
        assert wrong >= len(reqs) // 2, f"only {wrong} of {len(reqs)} wrong with the fix off"
    else:
        assert stats.blocks_skipped > 0
        assert wrong == 0


def test_failed_loads_recompute(ray_cluster, hybrid, reference):
    reqs, want = reference
    got, stats = run_pd(base(hybrid, debug_kv_fail_percent=20), reqs)
    assert [t for t, _, _ in got] == want
    assert all(r == "length" for _, r, _ in got)
    assert stats.extra["failed_loads"] > 0


def test_failed_loads_fail_policy(ray_cluster, hybrid, reference):
    reqs, want = reference
    got, stats = run_pd(base(hybrid, debug_kv_fail_percent=20, kv_load_failure_policy="fail"), reqs)
    failed = [(t, e) for t, r, e in got if r == "error"]
    assert 0 < len(failed) == stats.extra["failed_loads"]
    assert all("KV transfer" in e for _, e in failed)
    for (t, r, _), w in zip(got, want):
        if r != "error":
            assert t == w
