"""The engine as Ray actors on a local Ray cluster: same outputs as in-process, blocks back."""

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


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_ray_engine_equals_alone(ray_cluster, tmp_path, async_scheduling):
    save_hf_model("nemotron_h", tmp_path)
    cfg = Config(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=300,
        max_num_seqs=32,
        max_num_batched_tokens=128,
        async_scheduling=async_scheduling,
        worker_threads=1,
    )
    reqs = workload(32, seed=3)
    engine = RemoteEngine.remote(cfg.to_dict())
    ray.get(engine.ready.remote())

    async def main():
        client = EngineClient(EngineCalls.remote(ActorSlot(engine)))
        got = await serve_all(client, reqs)
        await client.close()
        return got

    got = asyncio.run(main())
    stats = ray.get(engine.wait_idle.remote())
    ray.get(engine.shutdown.remote())
    assert got == alone(str(tmp_path), reqs)
    assert stats.num_blocks_free == stats.num_blocks_total
