"""The engine end to end in one process (real scheduler, real worker, real model): many
concurrent requests give the same greedy tokens as each request run alone."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from actors.client import EngineCalls, EngineClient
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import SamplingParams
from models.loader import load_model
from models.reference import greedy_generate
from tests.models.hf_fixtures import save_hf_model


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, path)
    return request.param, str(path)


def workload(n: int, seed: int = 0, shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 90) for _ in range(shared_prefix)]
    return [
        (prefix + [rng.randrange(2, 90) for _ in range(rng.randrange(1, 48))], rng.randrange(1, 24)) for _ in range(n)
    ]


def alone(path: str, reqs) -> list[list[int]]:
    model = load_model(path, dtype=torch.float32).model
    return [greedy_generate(model, [p], n, eos_token_id=None, block_size=4)[0] for p, n in reqs]


async def serve_all(client: EngineClient, reqs) -> list[list[int]]:
    async def one(prompt, n):
        toks = []
        async for out in client.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
            toks.extend(out.new_token_ids)
        return toks

    return list(await asyncio.gather(*(one(p, n) for p, n in reqs)))


def run_local(cfg: Config, reqs) -> tuple[list[list[int]], object]:
    got, stats = run_local_waves(cfg, [reqs])
    return got[0], stats


def run_local_waves(cfg: Config, waves) -> tuple[list[list[list[int]]], object]:
    """Each wave of requests served concurrently once the one before has ended, on one engine."""

    async def main():
        core, worker = build_local_engine(cfg)
        client = EngineClient(EngineCalls.local(core))
        got = []
        for reqs in waves:
            got.append(await serve_all(client, reqs))
            await core.wait_idle()
            core.scheduler.kv.check_integrity()
        stats = core.stats()
        await client.close()
        await core.close()
        worker.close()
        return got, stats

    return asyncio.run(main())


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_concurrent_equals_alone(checkpoint, async_scheduling, pool):
    _kind, path = checkpoint
    reqs = workload(32)
    cfg = Config(
        model=path,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=600 if pool == "roomy" else 90,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        async_scheduling=async_scheduling,
        enable_prefix_caching=True,
    )
    got, stats = run_local(cfg, reqs)
    assert got == alone(path, reqs)
    assert stats.num_blocks_free == stats.num_blocks_total
    if pool == "tight":
        assert stats.extra["preemptions"] > 0


def test_prefix_caching_dense(checkpoint):
    kind, path = checkpoint
    if kind != "qwen3":
        pytest.skip("hybrid prefix caching: tests/engine/test_hybrid_prefix_cache.py")
    reqs = workload(16, seed=1, shared_prefix=24)
    cfg = Config(
        model=path,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=600,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    got, stats = run_local(cfg, reqs)
    assert got == alone(path, reqs)
    assert stats.num_blocks_free == stats.num_blocks_total
