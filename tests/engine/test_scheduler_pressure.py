"""Issue 8's findings, each reproduced at the level where it lived: tight pools, loads that
end while others preempt, aborts racing fences and adds, leases that run out."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Future

import pytest

from actors.client import EngineCalls, EngineClient
from engine.core import EngineCore
from engine.messages import InvalidRequestError, ModelRunnerOutput, SamplingParams, SchedulerOutput
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.kv_cache_manager import KVCacheManager
from kv.nixl.transfer_params import KVTransferParams
from tests.engine.test_pd import BS, DENSE, HYBRID, add, attention_ids, decode_scheduler, remote


def drive(s: Scheduler, max_steps: int = 200) -> dict[str, str]:
    """Run steps synchronously (every step reports before the next), sampling token 1 for every
    request that reaches its end and landing every load at once; the finish reason of each."""
    done: dict[str, str] = {}
    for _ in range(max_steps):
        if not s.has_work():
            return done
        out = s.schedule()
        assert out is not None, "the scheduler has work but plans nothing, with no step in flight: a hang"
        loads = [ld.req_id for ld in out.kv_connector_meta.loads] if out.kv_connector_meta else []
        result = ModelRunnerOutput(out.step_id, {r: 1 for r in out.num_scheduled_tokens}, finished_recving=loads)
        done |= {o.req_id: o.finish_reason for o in s.update_from_output(out, result) if o.finish_reason}
    raise AssertionError(f"no end after {max_steps} steps: {done}")


def test_finding1_local_hit_covering_the_grant_survives_a_failed_allocation():
    s = decode_scheduler(groups=DENSE, prefix=True, num_blocks=8)
    shared = list(range(1, 9))  # two full blocks
    add(s, "a", shared + [50], None)
    first = s.schedule()
    s.update_from_output(first, ModelRunnerOutput(first.step_id, {"a": 7}))
    cached = attention_ids(s, "a")[:2]
    s.abort("a")  # its two full blocks stay in the prefix cache
    add(s, "busy", list(range(100, 124)), None)  # six blocks: only the two cached ones stay free
    add(s, "d", shared + [60], remote("d", 8, DENSE))  # the local hit covers the whole grant
    busy = s.schedule()
    assert busy.num_scheduled_tokens == {"busy": 24}
    assert busy.kv_connector_meta is None  # "d" did not fit: the prefill side keeps its copy
    s.update_from_output(busy, ModelRunnerOutput(busy.step_id, {"busy": 1}))
    s.abort("busy")
    out = s.schedule()
    (new,) = out.new_reqs
    assert new.req_id == "d" and new.num_computed_tokens == 8
    assert new.block_ids[0][:2] == cached  # "computed" tokens really are in its pages
    assert out.kv_connector_meta.notify == (("agent-p", "d"),)


def test_finding2_a_loaded_request_is_not_starved_behind_a_preempted_one():
    s = decode_scheduler(num_blocks=10)
    s.add_request(Request("grow", list(range(12)), SamplingParams(max_tokens=20, temperature=0), None))
    add(s, "loaded", list(range(17)), remote("loaded", 16))  # 5 attention + 1 state block
    assert set(drive(s).values()) == {"length"}
    assert s.kv.num_free_blocks == s.kv.num_blocks and s.num_preemptions > 0


def test_finding3_an_idle_engine_holds_no_fenced_block():
    s = decode_scheduler(groups=DENSE)
    add(s, "r", list(range(14)), remote("r", 13, DENSE))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"r": attention_ids(s, "r")[2:]}))
    s.abort("r")
    while s.has_work():
        step = s.schedule()
        assert step is not None, "blocks fenced on a step that will never run"
        s.update_from_output(step, ModelRunnerOutput(step.step_id, {}))
    assert s.kv.num_free_blocks == s.kv.num_blocks


class HeldStep:
    """An executor whose steps finish only when the test says so; from then on at once."""

    def __init__(self) -> None:
        self.pending: list[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = []
        self.released = False

    def __call__(self, out: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        fut: Future[ModelRunnerOutput] = Future()
        self.pending.append((out, fut))
        if self.released:
            self.release()
        return asyncio.wrap_future(fut)

    def release(self) -> None:
        self.released = True
        for out, fut in self.pending:
            fut.set_result(ModelRunnerOutput(out.step_id, {r: 1 for r in out.num_scheduled_tokens}))
        self.pending.clear()


def test_finding4_wait_idle_waits_for_the_step_in_flight():
    async def main() -> None:
        s = decode_scheduler()
        ex = HeldStep()
        core = EngineCore(s, [ex], async_scheduling=True, eos_token_id=None)
        core.add_request("r", list(range(9)), SamplingParams(max_tokens=4, temperature=0))
        for _ in range(100):
            await asyncio.sleep(0.001)
            if ex.pending:
                break
        core.abort("r")
        idle = asyncio.ensure_future(core.wait_idle())
        await asyncio.sleep(0.05)
        assert not idle.done(), "wait_idle returned while the step using the blocks still runs"
        ex.release()
        await asyncio.wait_for(idle, 5)
        assert s.kv.num_free_blocks == s.kv.num_blocks
        await core.close()

    asyncio.run(main())


def test_finding5_a_client_cancelled_during_add_leaves_no_orphan():
    """A remote add_request cannot be taken back; the client's abort may even overtake it."""

    async def main() -> None:
        s = decode_scheduler()
        core = EngineCore(s, [HeldStep()], async_scheduling=True, eos_token_id=None)
        local = EngineCalls.local(core)
        started = asyncio.Event()

        async def slow_add(req_id, ids, sp, **kw):  # type: ignore[no-untyped-def]
            async def arrive() -> None:
                await asyncio.sleep(0.05)
                core.add_request(req_id, ids, sp, **kw)

            started.set()
            await asyncio.shield(asyncio.ensure_future(arrive()))

        client = EngineClient(EngineCalls(slow_add, local.abort, local.get_outputs))

        async def consume() -> None:
            async for _ in client.generate(list(range(9)), SamplingParams(max_tokens=50, temperature=0), "x"):
                pass

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)  # the add lands after the abort and is refused
        assert "x" not in s.requests and s.kv.num_free_blocks == s.kv.num_blocks
        with pytest.raises(InvalidRequestError, match="aborted"):
            core.add_request("x", [1, 2], SamplingParams(max_tokens=1, temperature=0))
        await core.close()

    asyncio.run(main())


def expiring(req_id: str, num_tokens: int, expires_at: float, groups=HYBRID) -> KVTransferParams:
    p = remote(req_id, num_tokens, groups)
    return KVTransferParams(
        p.remote_engine_id, p.remote_agent_name, p.remote_block_ids, p.num_tokens, p.request_id, expires_at
    )


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_finding6_no_read_starts_after_the_lease(policy):
    s = decode_scheduler(policy=policy)
    clock = [100.0]
    s.pd.connector.clock = lambda: clock[0]
    add(s, "d", list(range(10)), expiring("d", 9, expires_at=100.1))  # within the safety margin
    out = s.schedule()
    assert not (out and out.kv_connector_meta and out.kv_connector_meta.loads)
    if policy == "recompute":
        assert out.num_scheduled_tokens == {"d": 10} and out.new_reqs[0].num_computed_tokens == 0
    else:
        (failed,) = s.take_outputs() or [o for o in [] if o]
        assert failed.finish_reason == "error" and "lease" in failed.error
        assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.pd.num_expired_leases == 1


def test_finding6_a_read_that_ends_after_the_lease_counts_as_failed():
    s = decode_scheduler()
    clock = [100.0]
    s.pd.connector.clock = lambda: clock[0]
    add(s, "d", list(range(14)), expiring("d", 13, expires_at=110.0))
    out = s.schedule()
    assert len(out.kv_connector_meta.loads) == 1
    ids = attention_ids(s, "d")
    clock[0] = 111.0  # the prefill side may have reused its pages before the READ ended
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, finished_recving=["d"]))
    nxt = s.schedule()
    assert nxt.new_reqs[0].num_computed_tokens == 0  # recomputed, not trusted
    assert set(ids) <= set(nxt.new_block_ids_to_zero)  # I2 after an untrusted load
    assert s.pd.num_expired_leases == 1 and s.pd.num_failed_loads == 1


def test_a_request_the_worker_could_not_run_fails_alone():
    """Its blocks were published to the prefix cache when its step was scheduled; whoever took
    them as a hit before the failure came back fails with it (conservatively: the worker does
    not say whether the KV got written), and nobody else."""
    kv = KVCacheManager(DENSE, 40, BS, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(64, 8, 256), kv, StopChecker(None, 256))
    shared = list(range(1, 9))
    s.add_request(Request("bad", shared + [40], SamplingParams(max_tokens=3, temperature=0), None))
    s.add_request(Request("other", list(range(20, 29)), SamplingParams(max_tokens=3, temperature=0), None))
    step0 = s.schedule()
    s.add_request(Request("sharer", shared + [41], SamplingParams(max_tokens=3, temperature=0), None))
    step1 = s.schedule()  # async: "sharer" hits the blocks "bad" is still computing
    assert step1.new_reqs[0].num_computed_tokens == 8
    outs = s.update_from_output(step0, ModelRunnerOutput(step0.step_id, {"other": 1}, failed_reqs={"bad": "injected"}))
    ended = {o.req_id: o for o in outs if o.finish_reason}
    assert set(ended) == {"bad", "sharer"}
    assert ended["bad"].error == "injected" and "prefix" in ended["sharer"].error
    assert kv.get_computed_blocks("later", shared + [42]) == 0  # the lost blocks are not findable
    s.update_from_output(step1, ModelRunnerOutput(step1.step_id, {r: 1 for r in step1.num_scheduled_tokens}))
    assert drive(s) == {"other": "length"}
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


@pytest.mark.parametrize(
    "change",
    [{"request_id": 5}, {"remote_agent_name": ""}, {"num_tokens": -1}, {"remote_block_ids": [[100, 101]]}],
)
def test_malformed_transfer_params_are_refused_and_nothing_is_notified(change):
    """Params that fail validation name nobody to notify: their own agent or request id may be
    the malformed field, and a notification built from them would fail the worker's step."""

    async def main() -> None:
        s = decode_scheduler(num_blocks=12)
        core = EngineCore(s, [HeldStep()], async_scheduling=True, eos_token_id=None)
        bad = dataclasses.replace(remote("r", 8), **change)
        with pytest.raises(InvalidRequestError, match=next(iter(change))) as refused:
            core.add_request("r", list(range(9)), SamplingParams(max_tokens=4, temperature=0), bad)
        assert refused.value.param == "kv_transfer_params"
        assert not s.pd.connector.has_pending_meta and not s.has_work()
        assert not s.requests and s.kv.num_free_blocks == s.kv.num_blocks
        core.add_request("ok", list(range(9)), SamplingParams(max_tokens=4, temperature=0), remote("ok", 8))
        assert "ok" in s.requests
        await core.close()

    asyncio.run(main())
