"""PD with tensor parallelism under pressure, over real Ray, gloo and NIXL/UCX: a 24-block
decode pool and a 24-block prefill pool (each fits one long request at most) behind a long
queue, 20% of KV loads failing (recomputed), clients leaving at seeded points of a
request's life (in either engine's queue, mid prefill, during the hand-over or the load,
mid decode). Every request that ran to its end equals one process's (colocated TP=1)
greedy output token for token, every aborted one streamed a prefix of it, preemption and
failed loads really happened, and afterwards no engine holds a block and no rank holds a
request, a load, an unreported load or a partly counted notification."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import uuid
from contextlib import aclosing
from dataclasses import dataclass

import pytest
import ray
import torch

from actors.client import ActorSlot, EngineCalls, EngineClient
from actors.engine_actor import RemoteEngine
from engine.config import DEFAULT_MODEL
from engine.messages import EngineStats, SamplingParams
from tests.engine.test_core import alone, workload
from tests.pd.test_pd_engines import DEVICE
from tests.pd.test_pd_tp import config
from tests.ray_session import stop_actors

log = logging.getLogger(__name__)

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="TP=2 on CUDA needs two GPUs"
)

IDLE_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class Abort:
    """Where the client leaves: `after_s` after sending the request (wherever it then is),
    or once the decode side has streamed `after_tokens` tokens."""

    after_s: float | None = None
    after_tokens: int | None = None


@dataclass(slots=True)
class Outcome:
    tokens: list[int] = dataclasses.field(default_factory=list)
    reason: str | None = None
    error: str | None = None


def abort_plan(n: int, seed: int) -> list[Abort | None]:
    """About a third of the requests leave: half at a random time, half after a random
    number of decoded tokens."""
    rng = random.Random(seed)
    plan: list[Abort | None] = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.17:
            plan.append(Abort(after_s=rng.uniform(0.0, 2.0)))
        elif roll < 0.34:
            plan.append(Abort(after_tokens=rng.randrange(1, 8)))
        else:
            plan.append(None)
    return plan


async def pd_request(
    pre: EngineClient, dec: EngineClient, prompt: list[int], n: int, stop_at: int | None, got: Outcome
):
    """The router's PD path (api/router.py): prefill hands over, decode loads and streams."""
    req_id = f"tight-{uuid.uuid4().hex[:8]}"
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    params = None
    async with aclosing(pre.generate(prompt, sp, req_id, do_remote_decode=True)) as stream:
        async for out in stream:
            params = out.kv_transfer_params
    async with aclosing(dec.generate(prompt, sp, req_id, kv_transfer_params=params)) as stream:
        async for out in stream:
            got.tokens.extend(out.new_token_ids)
            got.reason, got.error = out.finish_reason, out.error
            if stop_at is not None and got.reason is None and len(got.tokens) >= stop_at:
                got.reason = "abort"  # leaving the stream aborts the decode request
                return


async def one(pre: EngineClient, dec: EngineClient, prompt: list[int], n: int, abort: Abort | None) -> Outcome:
    got = Outcome()
    coro = pd_request(pre, dec, prompt, n, abort.after_tokens if abort else None, got)
    if abort is None or abort.after_s is None:
        await coro
        return got
    try:
        await asyncio.wait_for(coro, abort.after_s)
    except TimeoutError:
        got.reason = "abort"
    return got


def serve(prefill, decode, reqs, plan: list[Abort | None]) -> list[Outcome]:
    async def main():
        pre, dec = (EngineClient(EngineCalls.remote(ActorSlot(h))) for h in (prefill, decode))
        res = await asyncio.gather(*(one(pre, dec, p, n, a) for (p, n), a in zip(reqs, plan)))
        await pre.close()
        await dec.close()
        return res

    return asyncio.run(main())


def idle_stats(engine) -> EngineStats:
    """The engine's stats once it is idle; every block back, every rank empty-handed."""
    idle = ray.get(engine.wait_idle.remote(), timeout=IDLE_TIMEOUT_S)
    assert idle.num_blocks_free == idle.num_blocks_total
    stats = ray.get(engine.stats.remote())
    assert stats.extra["rank_merge_partial"] == 0
    for rank, held in enumerate(stats.extra["ranks_held"]):
        assert held == dict.fromkeys(held, 0), f"rank {rank} still holds {held}"
    return stats


@pytest.fixture(scope="module")
def reference():
    reqs = workload(36, seed=13)
    return reqs, alone(DEFAULT_MODEL, reqs)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_tight_pools_aborts_and_failed_loads_under_tp(ray_cluster, reference, prefill_tp, decode_tp):
    reqs, want = reference
    plan = abort_plan(len(reqs), seed=prefill_tp * 10 + decode_tp)
    cfg = config(DEFAULT_MODEL, prefill_tp, decode_tp, debug_kv_fail_percent=20)
    cfg = dataclasses.replace(cfg, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
    prefill = RemoteEngine.remote(cfg.to_dict(), "prefill", "prefill-0")
    decode = RemoteEngine.remote(cfg.to_dict(), "decode", "decode-0")
    try:
        ray.get([prefill.ready.remote(), decode.ready.remote()])
        ray.get(decode.add_nixl_peers.remote(ray.get(prefill.nixl_peers.remote())))
        got = serve(prefill, decode, reqs, plan)
        pre_stats, dec_stats = idle_stats(prefill), idle_stats(decode)
    finally:
        stop_actors(prefill, decode)

    finished = [(g, w) for g, w in zip(got, want) if g.reason != "abort"]
    aborted = [(g, w) for g, w in zip(got, want) if g.reason == "abort"]
    assert all(g.reason == "length" and g.error is None for g, _ in finished), [g for g, _ in finished]
    assert [g.tokens for g, _ in finished] == [w for _, w in finished]
    assert all(g.tokens == w[: len(g.tokens)] for g, w in aborted)
    log.info(
        "TP (%d,%d): %d requests, %d finished, %d aborted; preemptions prefill %d decode %d; "
        "failed loads %d (per decode rank %s); expired leases %d; decode steps %d",
        prefill_tp,
        decode_tp,
        len(reqs),
        len(finished),
        len(aborted),
        pre_stats.extra["preemptions"],
        dec_stats.extra["preemptions"],
        dec_stats.extra["failed_loads"],
        [t.failed for t in dec_stats.extra["kv_transfer"]],
        pre_stats.extra["expired_leases"],
        dec_stats.extra["steps"],
    )
    assert len(finished) >= len(reqs) // 2 and aborted
    assert dec_stats.extra["preemptions"] > 0
    assert dec_stats.extra["failed_loads"] > 0
    # Every abort reached the prefill side through the decode side: none waited for its lease.
    assert pre_stats.extra["expired_leases"] == 0
