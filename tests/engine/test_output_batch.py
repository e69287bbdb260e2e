"""One `OutputBatch` per step: the common decode token as flat lists, everything else whole,
and what a client reads from it equal to one `RequestOutput` per request as before."""

from __future__ import annotations

import pickle

from engine.messages import ModelRunnerOutput, OutputBatch, RequestOutput, SamplingParams
from engine.phases import RequestPhases
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.cache_group import CacheGroup
from kv.kv_cache_manager import KVCacheManager

GROUPS = [CacheGroup("attention", (1,)), CacheGroup("mamba", (0,))]


def _scheduler() -> Scheduler:
    kv = KVCacheManager(GROUPS, 64, 4, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(64, 8, 256), kv, StopChecker(None, 256))


def _step(s: Scheduler, tokens: dict[str, int], logprobs: dict[str, float] | None = None) -> OutputBatch:
    out = s.schedule()
    assert out is not None
    return s.update_from_output(out, ModelRunnerOutput(out.step_id, tokens, logprobs or {}))


def test_plain_tokens_travel_as_lists_and_the_rest_whole():
    s = _scheduler()
    s.add_request(Request("plain", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0), None))
    s.add_request(Request("lp", [4, 5], SamplingParams(max_tokens=3, temperature=0, logprobs=True), None))
    first = _step(s, {"plain": 10, "lp": 20}, {"lp": -0.5})
    assert (first.req_ids, first.token_ids) == (["plain"], [10])
    assert (first.num_prompt_tokens, first.num_output_tokens) == ([3], [1])
    assert first.others == [RequestOutput("lp", [20], [-0.5], None, 2, 1)]
    second = _step(s, {"plain": 11, "lp": 21}, {"lp": -0.25})
    assert second.req_ids == []  # "plain" reached max_tokens: its last token comes whole, with the reason
    assert second.others == [
        RequestOutput("plain", [11], None, "length", 3, 2),
        RequestOutput("lp", [21], [-0.25], None, 2, 2),
    ]
    assert list(first) == [RequestOutput("plain", [10], None, None, 3, 1), first.others[0]]
    assert len(first) == 2 and not OutputBatch()


def test_a_request_failed_in_a_step_gets_its_token_before_its_error():
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0), None))
    _step(s, {"a": 9})
    out = s.schedule()
    assert out is not None
    batch = s.update_from_output(out, ModelRunnerOutput(out.step_id, {"a": 8}, failed_reqs={"a": "injected"}))
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in batch] == [("a", [8], None), ("a", [], "error")]


def test_a_batch_crosses_a_pickle_unchanged():
    batch = OutputBatch(["a", "b"], [1, 2], [3, 4], [5, 6], [RequestOutput("c", [], None, "abort", 1, 0)])
    assert pickle.loads(pickle.dumps(batch)) == batch


def test_phases_see_first_tokens_in_the_flat_lists():
    now = [0.0]
    phases = RequestPhases(clock=lambda: now[0])
    for req_id in ("a", "b"):
        phases.arrived(req_id)
    now[0] = 1.0
    phases.scheduled({"a": 4})
    now[0] = 3.0
    phases.scheduled({"a": 1, "b": 4})
    phases.outputs(OutputBatch(["a"], [7], [4], [1]))
    now[0] = 6.0
    phases.outputs(OutputBatch(["b"], [7], [4], [1]))
    now[0] = 10.0
    phases.outputs(OutputBatch(others=[RequestOutput("a", [8], None, "length", 4, 2)]))
    phases.outputs(OutputBatch(others=[RequestOutput("b", [], None, "abort", 4, 1)]))
    h = phases.snapshot()
    # Only "a" finished normally: queued 1 s, prefilled 2 s, decoded 7 s; "b" is not counted.
    assert [(sum(h[p].counts), h[p].total) for p in ("queue", "prefill", "decode")] == [(1, 1.0), (1, 2.0), (1, 7.0)]
    assert not phases._marks and not phases._unstarted and not phases._no_token
