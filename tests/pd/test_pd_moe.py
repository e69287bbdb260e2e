"""MoE hybrids served disaggregated: Qwen3.5-MoE (Gated DeltaNet + gated attention, every MLP
a mixture with a shared expert, loaded from the released multimodal directory) and NemotronH
with `moe` layers (Mamba2 + attention + MLP + latent MoE). Experts only replace MLPs, so the
handover is the hybrids' own (attention KV of prompt[:-1] plus the state after it); these
check it stays exact with the experts in, over real Ray actors and NIXL READs, with async
scheduling on: greedy outputs equal the colocated engine's token for token at TP (1,1),
(2,1) and (1,2), with 20% of loads failing under either policy, and the fix-off switch
still breaks them. Cases share runs: each run is a PD pair's start-up."""

from __future__ import annotations

import pytest
import torch

from engine.config import Config
from tests.engine.test_core import alone, run_local, workload
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import DEVICE, run_pd

FAMILIES = ["qwen3_5_moe", "nemotron_h_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(path, workload, colocated greedy outputs), the colocated engine checked against the
    model run alone."""
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, path)
    path = str(path)
    reqs = workload(16, seed=9)
    colocated, _ = run_local(config(path, 1, 1, prefill=0), reqs)
    assert colocated == alone(path, reqs)
    return path, reqs, colocated


def config(path: str, prefill_tp: int, decode_tp: int, **kw) -> Config:
    return Config(
        **{
            "model": path,
            "dtype": "float32",
            "device": DEVICE,
            "block_size": 4,
            "num_kv_blocks": 400,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 128,
            "worker_threads": 1,
            "async_scheduling": True,
            "prefill": 1,
            "prefill_tp": prefill_tp,
            "decode_tp": decode_tp,
            "seed": 3,
            **kw,
        }
    )


def two_gpus_or_cpu() -> bool:
    return DEVICE != "cuda" or torch.cuda.device_count() >= 2


def test_pd_equals_colocated_with_the_stream_lagging(ray_cluster, family):
    """The compute stream lags each step, so zeroing would land after the READs: with the fix
    the loaded blocks are skipped and every token is the colocated engine's."""
    path, reqs, want = family
    got, stats = run_pd(config(path, 1, 1, debug_stream_delay_ms=30), reqs)
    assert [t for t, _, _ in got] == want
    assert all(r == "length" and e is None for _, r, e in got)
    assert stats.blocks_skipped > 0


def test_fix_off_breaks_outputs(ray_cluster, family):
    path, reqs, want = family
    got, stats = run_pd(config(path, 1, 1, debug_stream_delay_ms=30, debug_zero_loaded_blocks=True), reqs)
    assert stats.blocks_skipped == 0
    assert sum(t != w for (t, _, _), w in zip(got, want)) >= len(reqs) // 2


@pytest.mark.skipif(not two_gpus_or_cpu(), reason="TP=2 on CUDA needs two GPUs")
def test_failed_loads_recompute_at_tp_2_1(ray_cluster, family):
    path, reqs, want = family
    got, stats = run_pd(config(path, 2, 1, debug_kv_fail_percent=20), reqs)
    assert [t for t, _, _ in got] == want
    assert all(e is None for _, _, e in got)
    assert stats.extra["failed_loads"] > 0


@pytest.mark.skipif(not two_gpus_or_cpu(), reason="TP=2 on CUDA needs two GPUs")
def test_failed_loads_fail_their_requests_at_tp_1_2(ray_cluster, family):
    """Under the `fail` policy a failed load fails its request with a clear error; every other
    request is the colocated engine's, token for token."""
    path, reqs, want = family
    got, stats = run_pd(config(path, 1, 2, debug_kv_fail_percent=20, kv_load_failure_policy="fail"), reqs)
    failed = [e for _, r, e in got if r == "error"]
    assert 0 < len(failed) == stats.extra["failed_loads"]
    assert all("KV transfer" in e for e in failed)
    for (t, r, _), w in zip(got, want):
        if r != "error":
            assert t == w
