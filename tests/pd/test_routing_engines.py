"""Routing over real engines, 2 prefill + 2 decode actors moving KV over NIXL: the same
shared-prefix requests routed round robin, cache-aware, and cache-aware with conditional
disaggregation (short uncached prompts computed on their decode engine) give the tokens of
each request run alone, on the shipped hybrid and on a dense Qwen3: hybrid prefix caching
over 2P2D; every block comes back (docs/design.md §22)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import ray

from actors.engine_actor import RemoteEngine
from api import Engine, PDRouter
from api.routing.policies import CacheAware, RoundRobin
from engine.config import Config
from engine.messages import SamplingParams
from tests.engine.test_core import alone
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import DEVICE, check_idle
from tests.ray_session import stop_actors

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid")


def start_2p2d(cfg: Config) -> dict[str, object]:
    names = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    handles = {n: RemoteEngine.remote(cfg.to_dict(), role, n) for n, role in names.items()}
    ray.get([h.ready.remote() for h in handles.values()])
    peers = [p for n in ("prefill-0", "prefill-1") for p in ray.get(handles[n].nixl_peers.remote())]
    prefill = {n: handles[n] for n in ("prefill-0", "prefill-1")}
    for n in ("decode-0", "decode-1"):
        ray.get(handles[n].add_nixl_peers.remote(peers))
        ray.get(handles[n].set_lease_peers.remote(prefill))
    return handles


def shared_prefix_requests(block_size: int, vocab: int) -> list[list[int]]:
    """Three system prompts of four blocks (a hybrid keeps a state checkpoint every fourth), each
    with four user turns of different lengths (some under a block past the prefix, some several
    blocks)."""
    rng = random.Random(5)
    systems = [[rng.randrange(2, vocab) for _ in range(4 * block_size)] for _ in range(3)]
    lengths = [block_size + 5, 3, 2 * block_size + 1, 2]  # the first wave takes the long ones
    return [s + [rng.randrange(2, vocab) for _ in range(n)] for s in systems for n in lengths]


async def route_all(handles, policy, min_prefill_tokens, prompts, max_tokens):
    """Every prompt through a fresh PDRouter over the same engines, in two waves (the second
    finds what the first cached); the tokens, the router's decisions and its fleet's hits."""
    router = PDRouter(
        [Engine.remote(n, handles[n]) for n in ("prefill-0", "prefill-1")],
        [Engine.remote(n, handles[n]) for n in ("decode-0", "decode-1")],
        policy=policy,
        min_prefill_tokens=min_prefill_tokens,
    )
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        outs = [o async for o in router.generate(prompt, sampling, f"{policy.name}-{min_prefill_tokens}-{i}")]
        assert outs[-1].finish_reason == "length", outs[-1]
        return [t for o in outs for t in o.new_token_ids]

    try:
        tokens = []
        for wave in (prompts[::2], prompts[1::2]):
            await router.refresh()
            tokens += await asyncio.gather(*(one(i, p) for i, p in enumerate(wave)))
        return tokens, dict(router.decisions)
    finally:
        await router.close()


@pytest.mark.parametrize("kind", ["tiny-hybrid", "qwen3"])
def test_cache_aware_and_local_prefill_give_round_robins_tokens(ray_cluster, tmp_path, kind):
    if kind == "qwen3":
        save_hf_model("qwen3", tmp_path)
        model, block_size, vocab = str(tmp_path), 4, 90
    else:
        model, block_size, vocab = SHIPPED, 48, 250
    cfg = Config(
        model=model, dtype="float32", device=DEVICE, block_size=block_size, num_kv_blocks=400, worker_threads=1
    )
    prompts = shared_prefix_requests(block_size, vocab)
    handles = start_2p2d(cfg)
    try:
        # Dense: the short turns stay local once their prefix is cached on their decode engine.
        # Hybrid: every prompt local (its decode engines hold no checkpoint at the system prompt's
        # end, only at the hand-over's), so the decode engines compute prompts and find hits.
        threshold = block_size + 2 if kind == "qwen3" else 10**6
        runs = {
            name: asyncio.run(route_all(handles, policy, n, prompts, 6))
            for name, policy, n in [  # conditional first: its first wave finds nothing cached
                ("conditional", CacheAware(), threshold),
                ("cache_aware", CacheAware(), 0),
                ("round_robin", RoundRobin(), 0),
            ]
        }
        check_idle(*handles.values())
    finally:
        stop_actors(*handles.values())
    baseline, decisions = runs["round_robin"]
    # Each request run alone, without any cache, in the order the waves return them.
    assert baseline == alone(model, [(p, 6) for p in prompts[::2] + prompts[1::2]])
    assert decisions == {("remote", "always_remote"): len(prompts)}
    assert runs["cache_aware"][0] == baseline
    tokens, decisions = runs["conditional"]
    assert tokens == baseline
    if kind == "qwen3":
        assert decisions[("local", "short_prompt")] > 0 and decisions[("remote", "long_prompt")] > 0
    else:
        assert decisions == {("local", "short_prompt"): len(prompts)}
