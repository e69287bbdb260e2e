"""The fix on the scheduler side (docs/design.md §2): blocks a remote KV load covers stay out of
the zero list, only for that step; failed loads are zeroed before recompute."""

from __future__ import annotations

import pytest

from engine.messages import ModelRunnerOutput, SamplingParams
from engine.request import Request, RequestStatus
from engine.scheduler import DisaggConfig, Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.cache_group import CacheGroup, cdiv
from kv.kv_cache_manager import KVCacheManager
from kv.nixl.transfer_params import KVTransferParams

BS = 4
HYBRID = (CacheGroup("attention", (1,)), CacheGroup("mamba", (0,)))
DENSE = (CacheGroup("attention", (0,)),)


def decode_scheduler(groups=HYBRID, prefix=False, debug=False, policy="recompute", num_blocks=40):
    kv = KVCacheManager(groups, num_blocks, BS, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    disagg = DisaggConfig("decode", "dec-0", debug_zero_loaded_blocks=debug, load_failure_policy=policy)
    return Scheduler(cfg, kv, StopChecker(None, 256), disagg)


def remote(req_id: str, num_tokens: int, groups=HYBRID) -> KVTransferParams:
    blocks = tuple(tuple(range(100, 100 + cdiv(num_tokens, BS))) if g.kind == "attention" else (500,) for g in groups)
    return KVTransferParams("pre-0", "agent-p", blocks, num_tokens, req_id)


def add(s: Scheduler, req_id: str, prompt: list[int], params: KVTransferParams | None) -> Request:
    req = Request(req_id, prompt, SamplingParams(max_tokens=4, temperature=0), None, kv_transfer_params=params)
    s.add_request(req)
    return req


def attention_ids(s: Scheduler, req_id: str) -> list[int]:
    return s.kv.get_block_ids(req_id)[0]


@pytest.mark.parametrize("prompt_len", [9, 12, 13])  # the grant (prompt - 1) may end mid-block
def test_covered_blocks_are_skipped_only_in_their_step(prompt_len):
    s = decode_scheduler()
    granted = prompt_len - 1
    add(s, "d", list(range(prompt_len)), remote("d", granted))
    out = s.schedule()
    assert out is not None and out.num_scheduled_tokens == {}
    blocks = attention_ids(s, "d")  # the whole prompt's blocks are allocated up front
    covered = blocks[: cdiv(granted, BS)]
    fresh = blocks[len(covered) :]
    assert len(fresh) == (1 if granted % BS == 0 else 0)
    assert (out.new_block_ids_to_zero or []) == fresh  # zeroed: the load does not write them
    (load,) = out.kv_connector_meta.loads
    assert list(load.block_ids[0]) == covered and len(load.block_ids[1]) == 1
    assert s.blocks_skipped == len(covered) and not s._skip_zero_block_ids
    # The load lands; the last prompt token is computed locally, into blocks it already has.
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, finished_recving=["d"]))
    nxt = s.schedule()
    assert nxt.num_scheduled_tokens == {"d": 1}
    assert nxt.new_reqs[0].num_computed_tokens == granted
    assert nxt.new_block_ids_to_zero is None


def test_mamba_blocks_never_in_a_zero_list_and_other_requests_still_zeroed():
    s = decode_scheduler()
    add(s, "local", list(range(10)), None)
    add(s, "d", list(range(10)), remote("d", 9))
    out = s.schedule()
    mamba = {s.kv.get_block_ids(r)[1][0] for r in ("local", "d")}
    assert set(out.new_block_ids_to_zero) == set(attention_ids(s, "local"))
    assert not mamba & set(out.new_block_ids_to_zero)


def test_debug_switch_zeroes_covered_blocks_again():
    s = decode_scheduler(debug=True)
    add(s, "d", list(range(10)), remote("d", 9))
    out = s.schedule()
    assert out.new_block_ids_to_zero == attention_ids(s, "d")
    assert s.blocks_skipped == 0


def test_local_prefix_hit_then_remote_load():
    s = decode_scheduler(groups=DENSE, prefix=True)
    shared = list(range(1, 9))  # two full blocks
    add(s, "a", shared + [50, 51], None)
    first = s.schedule()
    s.update_from_output(first, ModelRunnerOutput(first.step_id, {"a": 7}))
    hit_blocks = attention_ids(s, "a")[:2]
    add(s, "d", shared + [60, 61, 62, 63, 64], remote("d", 12, DENSE))
    out = s.schedule()
    ids = attention_ids(s, "d")
    assert ids[:2] == hit_blocks
    (load,) = out.kv_connector_meta.loads
    assert list(load.block_ids[0]) == ids[2:3]  # tokens 8..12 only: the hit is not reloaded
    assert list(load.params.remote_block_ids[0]) == [102]
    assert s.kv.get_zeroing_block_ids_in_range("d", 8, 12) == ids[2:3]
    assert not set(ids) & set(out.new_block_ids_to_zero or [])


def test_failed_load_on_dense_rerecords_from_first_invalid_block():
    s = decode_scheduler(groups=DENSE)
    add(s, "d", list(range(14)), remote("d", 13, DENSE))
    out = s.schedule()
    ids = attention_ids(s, "d")  # 4 blocks cover 13 tokens
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"d": [ids[2], ids[3]]}))
    nxt = s.schedule()
    # Dense models never need zeroing, so the re-recorded blocks are taken but sent as None;
    # the recompute starts at the first invalid block.
    assert nxt.new_reqs[0].num_computed_tokens == 2 * BS
    assert nxt.num_scheduled_tokens == {"d": 14 - 2 * BS}


def test_failed_load_on_hybrid_zeroes_every_block_and_recomputes():
    s = decode_scheduler()
    add(s, "d", list(range(14)), remote("d", 13))
    out = s.schedule()
    ids = attention_ids(s, "d")
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"d": [ids[3]]}))
    nxt = s.schedule()
    assert nxt.new_reqs[0].num_computed_tokens == 0
    assert set(ids) <= set(nxt.new_block_ids_to_zero)
    assert s.kv.get_block_ids("d")[1][0] not in nxt.new_block_ids_to_zero


def test_fail_policy_finishes_with_error_and_frees():
    s = decode_scheduler(policy="fail")
    add(s, "d", list(range(10)), remote("d", 9))
    out = s.schedule()
    outs = s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"d": [1]}))
    (failed,) = outs
    assert failed.finish_reason == "error" and "failed" in failed.error
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_while_loading_frees_only_after_the_transfer_ends():
    s = decode_scheduler()
    add(s, "d", list(range(10)), remote("d", 9))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}))
    s.abort("d")
    assert s.kv.num_free_blocks < s.kv.num_blocks  # the READ may still be writing
    poll = s.schedule()
    s.update_from_output(poll, ModelRunnerOutput(poll.step_id, {}, finished_recving=["d"]))
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_before_load_notifies_prefill():
    s = decode_scheduler(num_blocks=14)
    add(s, "local", list(range(30)), None)
    add(s, "big", list(range(30)), remote("big", 29))
    assert s.schedule().num_scheduled_tokens == {"local": 30}  # "big" does not fit yet
    s.abort("big")
    meta = s.pd.connector.build_connector_meta()
    assert meta.notify == (("agent-p", "big"),)


def test_prefill_side_holds_blocks_until_notified_or_lease():
    kv = KVCacheManager(HYBRID, 40, BS, enable_prefix_caching=False)
    clock = [0.0]
    s = Scheduler(
        SchedulerConfig(64, 8, 256),
        kv,
        StopChecker(None, 256),
        DisaggConfig("prefill", "pre-0", lease_s=5, agent_name="agent-p"),
    )
    s.pd.connector.clock = lambda: clock[0]
    for rid in ("x", "y"):
        s.add_request(
            Request(rid, list(range(9)), SamplingParams(max_tokens=1, temperature=0), None, do_remote_decode=True)
        )
    out = s.schedule()
    outs = s.update_from_output(out, ModelRunnerOutput(out.step_id, {"x": 1, "y": 1}))
    params = {o.req_id: o.kv_transfer_params for o in outs}
    assert params["x"].num_tokens == 9 and params["x"].remote_agent_name == "agent-p"
    held = kv.num_blocks - kv.num_free_blocks
    poll = s.schedule()
    s.update_from_output(poll, ModelRunnerOutput(poll.step_id, {}, finished_sending=["x"]))
    assert kv.num_blocks - kv.num_free_blocks == held // 2
    clock[0] = 6.0
    poll = s.schedule()
    s.update_from_output(poll, ModelRunnerOutput(poll.step_id, {}))
    assert kv.num_free_blocks == kv.num_blocks
    assert s.schedule() is None
    assert all(r.status is not RequestStatus.RUNNING for r in s.requests.values())


def test_abort_on_prefill_drops_held_blocks():
    kv = KVCacheManager(HYBRID, 40, BS, enable_prefix_caching=False)
    s = Scheduler(
        SchedulerConfig(64, 8, 256), kv, StopChecker(None, 256), DisaggConfig("prefill", "pre-0", agent_name="agent-p")
    )
    s.add_request(
        Request("x", list(range(9)), SamplingParams(max_tokens=1, temperature=0), None, do_remote_decode=True)
    )
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {"x": 1}))
    assert kv.num_free_blocks < kv.num_blocks
    s.abort("x")  # the client left before any decode engine took the request
    assert kv.num_free_blocks == kv.num_blocks and len(s.pd.held) == 0


def test_loads_fill_the_pool_without_deadlock():
    """Loaded requests own blocks for the whole prompt, so they always get to run."""
    s = decode_scheduler(num_blocks=8)
    for rid in ("a", "b"):
        add(s, rid, list(range(9)), remote(rid, 8))
    out = s.schedule()
    assert len(out.kv_connector_meta.loads) == 2
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, finished_recving=["a", "b"]))
    done: set[str] = set()
    for _ in range(20):
        step = s.schedule()
        if step is None:
            break
        sampled = {r: 1 for r in step.num_scheduled_tokens}
        done |= {
            o.req_id for o in s.update_from_output(step, ModelRunnerOutput(step.step_id, sampled)) if o.finish_reason
        }
    assert done == {"a", "b"} and s.kv.num_free_blocks == s.kv.num_blocks


def test_loads_count_against_max_num_seqs():
    kv = KVCacheManager(HYBRID, 200, BS, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(64, 3, 256), kv, StopChecker(None, 256), DisaggConfig("decode", "dec-0"))
    for i in range(6):
        add(s, f"r{i}", list(range(9)), remote(f"r{i}", 8))
    assert len(s.schedule().kv_connector_meta.loads) == 3


def test_abort_before_the_zeroing_ships_frees_at_once_and_zeroes_nothing():
    s = decode_scheduler()
    add(s, "r", list(range(14)), remote("r", 13))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"r": attention_ids(s, "r")}))
    s.abort("r")  # the zeroing recorded for the recompute was never shipped
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_work()
    assert s.schedule() is None


def test_a_step_that_zeroes_a_requests_blocks_fences_their_free():
    s = decode_scheduler()
    add(s, "r", list(range(14)), remote("r", 13))
    out = s.schedule()
    ids = attention_ids(s, "r")
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"r": ids}))
    zeroing = s.schedule()  # ships the zeroing (and the recompute)
    assert set(ids) <= set(zeroing.new_block_ids_to_zero)
    s.abort("r")
    assert s.kv.num_free_blocks < s.kv.num_blocks  # that step may still be zeroing them
    s.update_from_output(zeroing, ModelRunnerOutput(zeroing.step_id, {}))
    assert s.kv.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize(
    "params, why",
    [
        (remote("x", 12), "cover 12 tokens"),
        (KVTransferParams("p", "a", ((100,), (500,)), 8, "x"), "expected 2"),
        (KVTransferParams("p", "a", ((100, 101),), 8, "x"), "cache groups"),
    ],
)
def test_bad_transfer_params_are_rejected(params, why):
    from engine.messages import InvalidRequestError

    s = decode_scheduler()
    with pytest.raises(InvalidRequestError, match=why):
        add(s, "x", list(range(12)), params)


def test_request_id_cannot_be_reused_while_its_load_runs():
    from engine.messages import InvalidRequestError

    s = decode_scheduler()
    add(s, "x", list(range(9)), remote("x", 8))
    s.schedule()
    s.abort("x")
    with pytest.raises(InvalidRequestError, match="in use"):
        add(s, "x", list(range(9)), remote("x", 8))


def test_local_hit_covering_the_grant_releases_the_prefill_side():
    s = decode_scheduler(groups=DENSE, prefix=True)
    shared = list(range(1, 9))
    add(s, "a", shared + [50], None)
    first = s.schedule()
    s.update_from_output(first, ModelRunnerOutput(first.step_id, {"a": 7}))
    add(s, "d", shared + [60], remote("d", 8, DENSE))
    out = s.schedule()
    assert out.kv_connector_meta.notify == (("agent-p", "d"),)
    assert out.num_scheduled_tokens["d"] == 1


def test_hybrid_local_hit_then_load_and_a_failed_load_recomputes_from_the_hit():
    """docs/design.md §21: a hybrid decode engine hits its own cache (blocks and the state
    checkpoint at that boundary), loads only the rest with no restore queued behind the READ;
    when the load fails it recomputes from the hit, its slot restored from the checkpoint it
    holds, and only the blocks past the hit are zeroed."""
    s = decode_scheduler(prefix=True)
    shared = list(range(1, 9))  # two full blocks
    add(s, "a", shared + [50, 51], None)
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 8}  # the chunk ends at the prompt's last full block
    ((slot_a, checkpoint),) = first.state_saves
    s.update_from_output(first, ModelRunnerOutput(first.step_id, {}))
    second = s.schedule()
    s.update_from_output(second, ModelRunnerOutput(second.step_id, {"a": 7}))
    hit_blocks = attention_ids(s, "a")[:2]
    add(s, "d", shared + [60, 61, 62, 63, 64], remote("d", 12))
    out = s.schedule()
    ids = attention_ids(s, "d")
    assert ids[:2] == hit_blocks
    (load,) = out.kv_connector_meta.loads
    assert list(load.block_ids[0]) == ids[2:3]  # tokens 8..12 only, and the state after 12
    assert list(load.params.remote_block_ids[0]) == [102]
    assert not out.state_restores  # the READ writes the slot outside the stream
    (slot_d,) = s.kv.get_block_ids("d")[1]
    s.update_from_output(out, ModelRunnerOutput(out.step_id, {}, failed_loads={"d": ids[2:3]}))
    nxt = s.schedule()
    (new,) = [r for r in nxt.new_reqs if r.req_id == "d"]
    assert new.num_computed_tokens == 8
    assert (checkpoint, slot_d) in nxt.state_restores and slot_a != slot_d
    assert ids[2] in nxt.new_block_ids_to_zero and not set(hit_blocks) & set(nxt.new_block_ids_to_zero)
