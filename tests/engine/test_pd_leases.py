"""Lease heartbeats on the scheduler side (docs/design.md §12): a prefill scheduler extends
only leases it still holds; a decode scheduler asks for the leases its waiting and loading
requests need and goes by the deadlines granted."""

from __future__ import annotations

import dataclasses

from engine.messages import ModelRunnerOutput, SamplingParams
from engine.request import Request
from engine.scheduler import DisaggConfig, Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.kv_cache_manager import KVCacheManager
from tests.engine.test_pd import BS, HYBRID, add, decode_scheduler, remote


def prefill_scheduler(clock: list[float], tp_size: int = 1) -> Scheduler:
    kv = KVCacheManager(HYBRID, 40, BS, enable_prefix_caching=False)
    s = Scheduler(
        SchedulerConfig(64, 8, 256),
        kv,
        StopChecker(None, 256),
        DisaggConfig("prefill", "pre-0", lease_s=5, agent_name="agent-p", tp_size=tp_size),
    )
    s.pd.connector.clock = lambda: clock[0]
    return s


def test_prefill_renews_held_leases_only_and_a_renewed_lease_outlives_its_first_deadline():
    clock = [0.0]
    s = prefill_scheduler(clock)
    for rid in ("x", "y"):
        s.add_request(
            Request(rid, list(range(9)), SamplingParams(max_tokens=1, temperature=0), None, do_remote_decode=True)
        )
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {"x": 1, "y": 1}))
    clock[0] = 4.0
    assert s.pd.renew_leases(["x", "gone"]) == {"x": 9.0}
    clock[0] = 6.0  # y's first lease has ended, x's renewed one has not
    poll = s.schedule()
    s.update_from_output(poll, ModelRunnerOutput(poll.step_id, {}))
    assert len(s.pd.held) == 1 and s.pd.renew_leases(["y"]) == {}
    clock[0] = 9.5
    poll = s.schedule()
    s.update_from_output(poll, ModelRunnerOutput(poll.step_id, {}))
    assert len(s.pd.held) == 0 and s.kv.num_free_blocks == s.kv.num_blocks


def test_held_blocks_return_once_every_prefill_rank_was_read_and_late_notifications_are_dropped():
    clock = [0.0]
    s = prefill_scheduler(clock, tp_size=2)
    for rid in ("x", "y"):
        s.add_request(
            Request(rid, list(range(9)), SamplingParams(max_tokens=1, temperature=0), None, do_remote_decode=True)
        )
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {"x": 1, "y": 1}))
    assert s.pd.held["x"].expires_at == 5.0 and s.pd.held["x"].last_step == out.step_id

    def step(sent: list[str]) -> None:
        poll = s.schedule()
        s.update_from_output(poll, ModelRunnerOutput(poll.step_id, {}, finished_sending=sent))

    step(["x"])  # rank 0 of x read
    assert set(s.pd.held) == {"x", "y"}
    step(["x", "y"])  # rank 1 of x, rank 0 of y
    assert set(s.pd.held) == {"y"}
    clock[0] = 5.0  # y's lease ends before its second rank is read
    step([])
    assert s.pd.held == {} and not s.has_work() and s.kv.num_free_blocks == s.kv.num_blocks
    s.pd.transfers_ended(ModelRunnerOutput(99, {}, finished_sending=["y", "x"]))  # late: nothing held
    assert s.pd.held == {} and not s.has_work() and s.kv.num_free_blocks == s.kv.num_blocks


def test_decode_asks_for_waiting_and_loading_requests_and_keeps_granted_deadlines():
    s = decode_scheduler()
    s.pd.connector.clock = lambda: 0.0
    add(s, "a", list(range(10)), dataclasses.replace(remote("pa", 9), expires_at=10.0))
    out = s.schedule()  # a's load starts
    add(s, "b", list(range(10)), dataclasses.replace(remote("pb", 9), expires_at=10.0))  # b waits in the queue
    assert s.pd.leases_to_renew() == {"pre-0": {"pa": "a", "pb": "b"}}
    s.pd.lease_renewed({"a": 50.0, "b": 60.0})
    assert s.pd.loading["a"].kv_transfer_params.expires_at == 50.0
    assert s.requests["b"].kv_transfer_params.expires_at == 60.0
    s.pd.lease_renewed({"a": 40.0})  # an older answer never shortens a lease
    assert s.pd.loading["a"].kv_transfer_params.expires_at == 50.0
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, finished_recving=["a"]))
    assert s.pd.leases_to_renew() == {"pre-0": {"pb": "b"}}  # a's load ended: its lease is not needed
