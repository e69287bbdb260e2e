"""Hybrid prefix caching under PD, on real engines over Ray and NIXL/UCX: shared system
prompts and multi-turn chats (each turn the one before, its answer and a new message) on the
shipped hybrids and on random transformers-made NemotronH and Qwen3.5 configs give the greedy tokens of each request run alone, with the decode engine
hitting its own cache and loading only the rest, the prefill engine hitting its own, at
unequal TP, and with loads failing after a local hit (docs/design.md §21)."""

from __future__ import annotations

import pytest
import ray

from engine.config import Config
from tests.engine.test_hybrid_prefix_cache import waves_and_answers
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import DEVICE, check_idle, serve_pd, start_pd
from tests.ray_session import stop_actors

SHIPPED = {"tiny-hybrid": "models/tiny-hybrid", "tiny-qwen35": "models/tiny-qwen35"}
RANDOM = ("nemotron_h", "qwen3_5")  # transformers-made, saved as released


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = dict(SHIPPED)
    for kind in RANDOM:
        path = tmp_path_factory.mktemp(kind)
        save_hf_model(kind, path)
        paths[kind] = str(path)
    return paths


@pytest.fixture(scope="module")
def workloads(models):
    return {name: waves_and_answers(path) for name, path in models.items()}


@pytest.mark.parametrize(
    "model, prefill_tp, decode_tp, async_scheduling, fail_percent",
    [
        ("tiny-hybrid", 1, 1, True, 0),
        ("tiny-qwen35", 1, 1, False, 0),
        ("tiny-hybrid", 2, 1, True, 0),
        ("tiny-qwen35", 1, 2, True, 30),
        ("nemotron_h", 1, 2, True, 0),
        ("qwen3_5", 2, 1, True, 30),
    ],
)
def test_pd_hybrid_prefix_hits_equal_outputs_alone(
    ray_cluster, models, workloads, model, prefill_tp, decode_tp, async_scheduling, fail_percent
):
    waves, answers = workloads[model]
    cfg = Config(
        model=models[model],
        dtype="float32",
        device=DEVICE,
        block_size=4,
        num_kv_blocks=400,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        worker_threads=1,
        async_scheduling=async_scheduling,
        prefill=1,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefix_cache_checkpoint_interval=1,
        debug_kv_fail_percent=fail_percent,
    )
    prefill, decode = start_pd(cfg)
    try:
        got = [serve_pd(prefill, decode, wave) for wave in waves]
        check_idle(prefill, decode)
        pre, dec = ray.get([prefill.stats.remote(), decode.stats.remote()])
    finally:
        stop_actors(prefill, decode)
    assert [[t for t, _, _ in wave] for wave in got] == answers
    assert dec.extra["prefix_cache_hits"] > 0  # the decode engine's own cache, before any load
    assert dec.extra["loaded_tokens"] > 0  # and the rest loaded
    assert pre.extra["prefix_cache_hits"] > 0
    if fail_percent:
        assert dec.extra["failed_loads"] > 0
