"""Colocated engines with two tensor-parallel worker actors over real Ray and gloo: greedy
outputs equal one process's, and every block comes back."""

from __future__ import annotations

import asyncio

import pytest
import ray

from actors.client import ActorSlot, EngineCalls, EngineClient
from actors.config import Config
from actors.engine_actor import RemoteEngine
from tests.actors.test_engine import alone, serve_all, workload
from tests.models.hf_fixtures import save_hf_model


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize(
    "kind, overrides",
    [("nemotron_h", {"n_groups": 1}), ("qwen3", {"num_key_value_heads": 1})],
    ids=["nemotron_h-1group", "qwen3-1kv"],
)
def test_tp2_engine_equals_alone(ray_cluster, tmp_path, kind, overrides):
    save_hf_model(kind, tmp_path, **overrides)
    cfg = Config(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=300,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        async_scheduling=True,
        worker_threads=1,
        tensor_parallel_size=2,
    )
    reqs = workload(12, seed=5)
    engine = RemoteEngine.remote(cfg.to_dict())
    ray.get(engine.ready.remote())

    async def main():
        client = EngineClient(EngineCalls.remote(ActorSlot(engine)))
        got = await serve_all(client, reqs)
        await client.close()
        return got

    try:
        got = asyncio.run(main())
        stats = ray.get(engine.wait_idle.remote())
    finally:
        ray.get(engine.shutdown.remote())
    assert got == alone(str(tmp_path), reqs)
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.extra["steps"] > 0


def test_tp_the_heads_cannot_split_is_a_config_error(ray_cluster, tmp_path):
    save_hf_model("qwen3", tmp_path)
    cfg = Config(model=str(tmp_path), device="cpu", num_kv_blocks=64, tensor_parallel_size=3)
    with pytest.raises(ray.exceptions.RayActorError, match="invalid tensor_parallel_size 3"):
        ray.get(RemoteEngine.remote(cfg.to_dict()).ready.remote())
