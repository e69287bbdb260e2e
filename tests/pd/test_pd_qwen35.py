"""A Qwen3.5-style hybrid (Gated DeltaNet + gated attention) served disaggregated.

The prefill engine hands over the attention KV of prompt[:-1] and the Gated DeltaNet conv
and recurrent state after prompt[:-1] (one state page per state group); the decode engine
recomputes the last prompt token. With real NIXL READs between Ray actors, greedy outputs
equal the colocated engine's token for token, and with the fix off the lagging stream's
zeroing wipes the loaded KV while the state survives.
"""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.engine.test_core import alone, run_local, workload
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import run_pd


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    save_hf_model("qwen3_5", path)
    return str(path)


def base(path: str, **kw) -> Config:
    return Config(
        model=path,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=800,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        worker_threads=1,
        **kw,
    )


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_pd_equals_colocated(ray_cluster, qwen35, async_scheduling):
    reqs = workload(64, seed=11)
    colocated, _ = run_local(base(qwen35, async_scheduling=async_scheduling), reqs)
    assert colocated == alone(qwen35, reqs)
    got, stats = run_pd(base(qwen35, async_scheduling=async_scheduling), reqs)
    assert [t for t, _, _ in got] == colocated
    assert all(r == "length" and e is None for _, r, e in got)
    assert stats.blocks_skipped > 0


@pytest.mark.parametrize("debug_zero", [False, True])
def test_lagging_stream_wipes_loaded_kv_only_without_the_fix(ray_cluster, qwen35, debug_zero):
    reqs = workload(24, seed=5)
    want = alone(qwen35, reqs)
    got, stats = run_pd(base(qwen35, debug_stream_delay_ms=30, debug_zero_loaded_blocks=debug_zero), reqs)
    wrong = sum(t != w for (t, _, _), w in zip(got, want))
    if debug_zero:
        assert stats.blocks_skipped == 0
        assert wrong >= len(reqs) // 2, f"only {wrong} of {len(reqs)} wrong with the fix off"
    else:
        assert stats.blocks_skipped > 0
        assert wrong == 0
