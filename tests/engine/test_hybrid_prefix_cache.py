"""Hybrid prefix caching end to end in one process (real scheduler, worker and model):
shared system prompts and multi-turn chats on random transformers-made NemotronH (Mamba2)
and Qwen3.5 (Gated DeltaNet) models give the same greedy tokens as each request run alone,
with prefix hits really taken (docs/design.md §21)."""

from __future__ import annotations

import random

import pytest

from engine.config import Config
from tests.engine.test_core import alone, run_local_waves
from tests.models.hf_fixtures import save_hf_model


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, path)
    return str(path)


def waves_and_answers(path: str, seed: int = 0) -> tuple[list[list[tuple[list[int], int]]], list[list[list[int]]]]:
    """Waves of requests, each served after the one before has ended, and each request's
    greedy answer run alone: two system prompts under many questions, and chats whose next
    turn is the turn before, its answer and a new message."""
    rng = random.Random(seed)
    systems = [[rng.randrange(2, 90) for _ in range(37)] for _ in range(2)]
    shared = [(rng.choice(systems) + [rng.randrange(2, 90) for _ in range(rng.randrange(1, 12))], 6) for _ in range(8)]
    chats = [[rng.randrange(2, 90) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    waves = [shared + [(c, 9) for c in chats]]
    answers = [alone(path, waves[0])]
    for _ in range(2):
        chats = [
            c + a + [rng.randrange(2, 90) for _ in range(rng.randrange(1, 9))] for c, a in zip(chats, answers[-1][-3:])
        ]
        waves.append([(c, 9) for c in chats])
        answers.append(alone(path, waves[-1]))
    return waves, answers


@pytest.fixture(scope="module")
def workload(hybrid):
    return waves_and_answers(hybrid)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_hybrid_prefix_hits_equal_outputs_without_them(hybrid, workload, async_scheduling):
    waves, answers = workload
    cfg = Config(
        model=hybrid,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=400,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        enable_prefix_caching=True,
    )
    got, stats = run_local_waves(cfg, waves)
    assert got == answers
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.extra["prefix_cache_hits"] > 0
