"""Prefill and decode engines as Ray actors moving real KV bytes over NIXL/UCX: greedy
outputs equal the colocated ones token for token, and every block comes back."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import pytest
import ray

from actors.client import ActorSlot, EngineCalls, EngineClient
from actors.engine_actor import RemoteEngine
from engine.config import Config
from engine.messages import SamplingParams
from tests.engine.test_core import alone, workload
from tests.models.hf_fixtures import save_hf_model
from tests.ray_session import stop_actors

# `make gpu-check` sets cuda: the caches then live in VRAM and NIXL moves VRAM.
DEVICE = os.environ.get("RAYPD_TEST_DEVICE", "cpu")


def start_pd(cfg: Config):
    prefill = RemoteEngine.remote(cfg.to_dict(), "prefill", "prefill-0")
    decode = RemoteEngine.remote(cfg.to_dict(), "decode", "decode-0")
    ray.get([prefill.ready.remote(), decode.ready.remote()])
    ray.get(decode.add_nixl_peers.remote(ray.get(prefill.nixl_peers.remote())))
    ray.get(decode.set_lease_peers.remote({"prefill-0": prefill}))
    return prefill, decode


async def pd_generate(pre: EngineClient, dec: EngineClient, prompt, sampling):
    req_id = f"pd-{uuid.uuid4().hex[:8]}"
    params = None
    async for out in pre.generate(prompt, sampling, req_id, do_remote_decode=True):
        params = out.kv_transfer_params
    toks, reason, err = [], None, None
    async for out in dec.generate(prompt, sampling, req_id, kv_transfer_params=params):
        toks.extend(out.new_token_ids)
        reason, err = out.finish_reason, out.error
    return toks, reason, err


def serve_pd(prefill, decode, reqs):
    async def main():
        pre, dec = (EngineClient(EngineCalls.remote(ActorSlot(h))) for h in (prefill, decode))
        sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
        res = await asyncio.gather(*(pd_generate(pre, dec, p, sp(n)) for p, n in reqs))
        await pre.close()
        await dec.close()
        return res

    return asyncio.run(main())


def check_idle(*engines):
    for e in engines:
        stats = ray.get(e.wait_idle.remote())
        assert stats.num_blocks_free == stats.num_blocks_total


def torch_loaded(engine) -> bool:
    """Whether the engine's process has imported torch (only its workers should: docs/design.md §14)."""
    return ray.get(engine.__ray_call__.remote(lambda _self: "torch" in sys.modules))


def run_pd(cfg: Config, reqs):
    """Serve `reqs` on a fresh 1P1D pair; check both return every block, having moved the KV
    without loading torch in the engines' processes; the decode stats."""
    prefill, decode = start_pd(cfg)
    try:
        got = serve_pd(prefill, decode, reqs)
        check_idle(prefill, decode)
        assert not torch_loaded(prefill) and not torch_loaded(decode)
        stats = ray.get(decode.stats.remote())
    finally:
        stop_actors(prefill, decode)
    return got, stats


@pytest.mark.parametrize("kind", ["nemotron_h", "qwen3"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_pd_equals_colocated(ray_cluster, tmp_path, kind, async_scheduling):
    save_hf_model(kind, tmp_path)
    cfg = Config(
        model=str(tmp_path),
        dtype="float32",
        device=DEVICE,
        block_size=4,
        num_kv_blocks=800,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        async_scheduling=async_scheduling,
        worker_threads=1,
    )
    reqs = workload(64, seed=11)
    got, stats = run_pd(cfg, reqs)
    assert [t for t, _, _ in got] == alone(str(tmp_path), reqs)
    if kind == "nemotron_h":
        assert stats.blocks_skipped > 0
