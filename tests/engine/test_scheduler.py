"""Scheduler behaviour against a model-free worker: token accounting under async
scheduling, chunked prefill, preemption, fences and zero lists."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.client import EngineCalls, EngineClient
from engine.core import EngineCore
from engine.messages import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.cache_group import CacheGroup
from kv.kv_cache_manager import KVCacheManager
from tests.engine.fake_worker import FakeWorker, reference

HYBRID = [CacheGroup("attention", (1, 4)), CacheGroup("mamba", (0, 3))]
DENSE = [CacheGroup("attention", (0, 1))]


def make(groups=HYBRID, num_blocks=200, block_size=4, budget=64, seqs=32, prefix=False):
    kv = KVCacheManager(groups, num_blocks, block_size, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=512)
    return Scheduler(cfg, kv, StopChecker(None, 512))


def run(sched: Scheduler, worker: FakeWorker, requests, async_scheduling: bool):
    async def main():
        core = EngineCore(
            sched, [lambda out: asyncio.wrap_future(worker.execute_model(out))], async_scheduling, eos_token_id=None
        )
        client = EngineClient(EngineCalls.local(core))

        async def one(i, prompt, sp):
            toks, reason = [], None
            async for out in client.generate(prompt, sp, req_id=f"r{i}"):
                toks.extend(out.new_token_ids)
                reason = out.finish_reason
            return toks, reason

        results = await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(requests)))
        await core.wait_idle()
        await core.close()
        return results

    return asyncio.run(main())


def workload(n=32, seed=0, max_len=40):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(50) for _ in range(rng.randrange(1, max_len))],
            SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks,budget", [(400, 64), (400, 7), (60, 64), (40, 16)])
def test_outputs_match_reference_and_blocks_return(async_scheduling, num_blocks, budget):
    sched, worker = make(num_blocks=num_blocks, budget=budget), FakeWorker()
    reqs = workload()
    results = run(sched, worker, reqs, async_scheduling)
    for (prompt, sp), (toks, reason) in zip(reqs, results):
        assert toks == reference(prompt, sp.max_tokens)
        assert reason == "length"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_integrity()
    assert not worker.tokens, "an idle engine's worker still holds finished requests"
    if num_blocks <= 60:
        assert sched.num_preemptions > 0


def test_zero_lists_hold_exactly_new_attention_blocks():
    sched, worker = make(num_blocks=60, budget=16), FakeWorker()
    run(sched, worker, workload(16), async_scheduling=True)
    mamba = set()
    for out in worker.steps:
        for new in out.new_reqs:
            mamba.update(new.block_ids[1])
        ids = out.new_block_ids_to_zero or []
        assert len(ids) == len(set(ids))
        scheduled_attention = set()
        for new in out.new_reqs:
            scheduled_attention.update(new.block_ids[0])
        for c in out.cached_reqs:
            scheduled_attention.update(c.new_block_ids[0])
        assert set(ids) == scheduled_attention
    assert worker.zeroed


def test_dense_model_sends_no_zero_list():
    sched, worker = make(groups=DENSE), FakeWorker()
    run(sched, worker, workload(8), async_scheduling=True)
    assert all(out.new_block_ids_to_zero is None for out in worker.steps)


def test_freed_blocks_wait_for_the_last_step_that_used_them():
    sched = make(num_blocks=20)
    sched.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1, temperature=0), None))
    step0 = sched.schedule()
    assert step0 is not None
    free_during = sched.kv.num_free_blocks
    sched.abort("a")  # step 0 still runs and writes a's blocks
    assert sched.kv.num_free_blocks == free_during
    sched.update_from_output(step0, FakeWorker().run(step0))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_max_tokens_and_eos_stop_exactly():
    prompt = [3, 1, 4]
    eos = reference(prompt, 10)[4]
    sched, worker = make(), FakeWorker()

    async def main():
        core = EngineCore(sched, [lambda out: asyncio.wrap_future(worker.execute_model(out))], True, eos)
        core.add_request("x", prompt, SamplingParams(max_tokens=10, temperature=0))
        got = []
        while True:
            outs = [o for batch in await core.get_outputs(1.0) for o in batch]
            got.extend(t for o in outs for t in o.new_token_ids)
            if any(o.finish_reason for o in outs):
                await core.close()
                return got, outs[-1].finish_reason

    toks, reason = asyncio.run(main())
    assert toks == reference(prompt, 10, eos) and reason == "stop"


def test_prefix_cache_hit_on_dense_model():
    sched, worker = make(groups=DENSE, prefix=True), FakeWorker(prefix_sharing=True)
    shared = list(range(1, 17))
    reqs = [(shared + [20 + i], SamplingParams(max_tokens=3, temperature=0)) for i in range(4)]
    results = run(sched, worker, reqs[:1], async_scheduling=True)
    results += run(sched, worker, reqs[1:], async_scheduling=True)
    for (p, _sp), (toks, _) in zip(reqs, results):
        assert toks == reference(p, 3)
    later = [n.num_computed_tokens for s in worker.steps for n in s.new_reqs][1:]
    assert all(c == 16 for c in later)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64])
def test_seed_outside_64_bits_is_a_clear_error(seed):
    from engine.messages import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed, temperature=1.0).validate()
