"""The engine as Ray actors on a local Ray cluster, with one worker actor or two tensor-parallel
ones over gloo: same outputs as in-process, every block back."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import ray

from actors.client import ActorSlot, EngineCalls, EngineClient, EngineLostError
from actors.engine_actor import RemoteEngine
from actors.worker_actor import RemoteWorker
from engine.build import make_engine, worker_config
from engine.config import Config
from engine.messages import EngineStats, SamplingParams
from tests.engine.test_core import alone, serve_all, workload
from tests.models.hf_fixtures import save_hf_model
from tests.ray_session import stop_actors


def config(path, **kw) -> Config:
    base = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=300, worker_threads=1)
    return Config(model=str(path), **(base | kw))


def serve_remote(
    cfg: Config, reqs: list[tuple[list[int], int]], output_channel: bool = True
) -> tuple[list[list[int]], EngineStats]:
    """Every request's tokens from a `RemoteEngine`, and its stats once idle; the outputs read
    from its output channel, or polled by `get_outputs` calls."""
    engine = RemoteEngine.remote(cfg.to_dict())
    ray.get(engine.ready.remote())

    async def main():
        calls = EngineCalls.remote(ActorSlot(engine))
        if not output_channel:  # as a client on another node does
            client_id = calls.get_outputs.__self__._client_id
            calls = dataclasses.replace(
                calls, get_outputs=lambda timeout: engine.get_outputs.remote(timeout, client_id)
            )
        client = EngineClient(calls)
        got = await serve_all(client, reqs)
        if output_channel:  # this process is on the engine's node: they came over the socket
            assert calls.get_outputs.__self__._feed is not None
        await client.close()
        return got

    try:
        # Its workers are on this node, so every rank is sent its steps over a step channel.
        assert ray.get(engine.__ray_call__.remote(lambda e: [ch is not None for ch in e._channels])) == [True] * (
            cfg.tensor_parallel_size or 1
        )
        return asyncio.run(main()), ray.get(engine.wait_idle.remote())
    finally:
        stop_actors(engine)


@pytest.mark.parametrize(
    "async_scheduling, output_channel", [(True, True), (False, True), (True, False)], ids=["async", "sync", "polled"]
)
def test_ray_engine_equals_alone(ray_cluster, tmp_path, async_scheduling, output_channel):
    save_hf_model("nemotron_h", tmp_path)
    cfg = config(tmp_path, max_num_seqs=32, max_num_batched_tokens=128, async_scheduling=async_scheduling)
    reqs = workload(32, seed=3)
    got, stats = serve_remote(cfg, reqs, output_channel)
    assert got == alone(str(tmp_path), reqs)
    assert stats.num_blocks_free == stats.num_blocks_total


def test_two_clients_of_one_engine_each_get_their_own_outputs(ray_cluster, tmp_path):
    """Two API replicas share every engine: each client's requests' outputs reach that client
    alone (actors/output_mux.py), one over its output channel and one by polling, and both
    equal the model alone."""
    save_hf_model("nemotron_h", tmp_path)
    cfg = config(tmp_path, max_num_seqs=32, max_num_batched_tokens=128)
    reqs = workload(24, seed=6)
    engine = RemoteEngine.remote(cfg.to_dict())
    ray.get(engine.ready.remote())

    async def main():
        channel = EngineCalls.remote(ActorSlot(engine))
        polled = EngineCalls.remote(ActorSlot(engine))
        client_id = polled.get_outputs.__self__._client_id
        polled = dataclasses.replace(polled, get_outputs=lambda timeout: engine.get_outputs.remote(timeout, client_id))
        clients = [EngineClient(channel), EngineClient(polled)]
        halves = await asyncio.gather(serve_all(clients[0], reqs[::2]), serve_all(clients[1], reqs[1::2]))
        await asyncio.gather(*(c.close() for c in clients))
        return halves

    try:
        evens, odds = asyncio.run(asyncio.wait_for(main(), 120))
        stats = ray.get(engine.wait_idle.remote())
    finally:
        stop_actors(engine)
    want = alone(str(tmp_path), reqs)
    assert evens == want[::2] and odds == want[1::2]
    assert stats.num_blocks_free == stats.num_blocks_total


def test_steps_by_actor_calls_equal_alone(ray_cluster, tmp_path):
    """The path for a worker Ray placed on another node than its engine: every step an
    `execute_model` actor call, two in flight, which the worker actor keeps in order."""
    save_hf_model("nemotron_h", tmp_path)
    cfg = config(tmp_path, max_num_seqs=32, max_num_batched_tokens=128, async_scheduling=True)
    reqs = workload(24, seed=4)
    worker = RemoteWorker.remote(worker_config(cfg), num_threads=1)

    async def main():
        core = make_engine(cfg, await worker.layout.remote(), [worker.execute_model.remote])
        client = EngineClient(EngineCalls.local(core))
        got = await serve_all(client, reqs)
        await core.wait_idle()
        core.scheduler.kv.check_integrity()
        await client.close()
        await core.close()
        return got, core.num_steps

    try:
        got, steps = asyncio.run(main())
    finally:
        stop_actors(worker)
    assert got == alone(str(tmp_path), reqs)
    assert steps > 0


def test_a_worker_that_dies_fails_its_engines_requests_at_once(ray_cluster, tmp_path):
    """The engine hears of it from the step channel closing: its requests end with the engine's
    failure, which the ingress resumes elsewhere, instead of waiting for a step that never ends."""
    save_hf_model("nemotron_h", tmp_path)
    engine = RemoteEngine.remote(config(tmp_path, max_num_seqs=4).to_dict())
    ray.get(engine.ready.remote())
    (worker,) = ray.get(engine.__ray_call__.remote(lambda e: e.workers))

    async def main():
        client = EngineClient(EngineCalls.remote(ActorSlot(engine)))
        outs = []
        with pytest.raises(EngineLostError, match="WorkerLostError"):
            async for out in client.generate([5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True)):
                outs.append(out)
                if len(outs) == 3:
                    ray.kill(worker)
        await client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        ray.kill(engine)  # its shutdown would fail on the dead worker


@pytest.mark.parametrize(
    "kind, overrides",
    [("nemotron_h", {"n_groups": 1}), ("qwen3", {"num_key_value_heads": 1})],
    ids=["nemotron_h-1group", "qwen3-1kv"],
)
def test_tp2_engine_equals_alone(ray_cluster, tmp_path, kind, overrides):
    save_hf_model(kind, tmp_path, **overrides)
    cfg = config(tmp_path, max_num_seqs=16, max_num_batched_tokens=64, async_scheduling=True, tensor_parallel_size=2)
    reqs = workload(12, seed=5)
    got, stats = serve_remote(cfg, reqs)
    assert got == alone(str(tmp_path), reqs)
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.extra["steps"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="keeping off a CPU needs another one")
@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_worker_cpus_bind_the_forward_and_keep_the_engine_off_them(ray_cluster, tmp_path, role):
    """`--worker-cpus` for a colocated engine; `--prefill-worker-cpus` / `--decode-worker-cpus`
    for an engine of that role in a 1P1D layout."""
    save_hf_model("qwen3", tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    own = (
        {"worker_cpus": str(cpus[-1])} if role == "colocated" else {"prefill": 1, f"{role}_worker_cpus": str(cpus[-1])}
    )
    cfg = config(tmp_path, max_num_seqs=8, max_num_batched_tokens=64, **own)
    engine = RemoteEngine.remote(cfg.to_dict(), role, f"{role}-0")
    try:
        ray.get(engine.ready.remote())
        (worker,) = ray.get(engine.__ray_call__.remote(lambda e: e.workers))
        forward = ray.get(
            worker.__ray_call__.remote(lambda w: w._worker._stream.submit(os.sched_getaffinity, 0).result())
        )
        assert forward == {cpus[-1]}
        assert ray.get(engine.__ray_call__.remote(lambda e: sorted(os.sched_getaffinity(0)))) == cpus[:-1]
    finally:
        stop_actors(engine)


def test_tp_the_heads_cannot_split_is_a_config_error(ray_cluster, tmp_path):
    save_hf_model("qwen3", tmp_path)
    cfg = Config(model=str(tmp_path), device="cpu", num_kv_blocks=64, tensor_parallel_size=3)
    with pytest.raises(ray.exceptions.RayActorError, match="invalid tensor_parallel_size 3"):
        ray.get(RemoteEngine.remote(cfg.to_dict()).ready.remote())
