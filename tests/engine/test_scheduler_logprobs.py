"""The scheduler's side of logprobs and stop token ids: a chunked prompt's logprobs are
collected chunk by chunk and sent once with the first output, a chunk computed again adds
nothing twice, a gap fails that request alone, a prompt-logprobs request skips the prefix
cache, and a stop token id ends a request."""

from __future__ import annotations

from engine.messages import Logprobs, ModelRunnerOutput, SamplingParams
from engine.request import Request
from tests.engine.test_scheduler import DENSE, make

PROMPT = list(range(10, 20))


def _scores(start: int, n: int) -> Logprobs:
    """Made-up prompt logprobs for tokens start..start+n-1: -token index, one alternative."""
    return Logprobs(start, [-float(i) for i in range(start, start + n)], [[(i, -0.5)] for i in range(start, start + n)])


def _step(sched, sampled: dict[str, int], prompt_logprobs: dict[str, Logprobs], **kw):
    out = sched.schedule()
    result = ModelRunnerOutput(out.step_id, sampled, prompt_logprobs=prompt_logprobs, **kw)
    return out, list(sched.update_from_output(out, result))


def test_chunked_prompt_logprobs_go_out_once_with_the_first_token():
    sched = make(budget=4)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=1, prompt_logprobs=1)
    sched.add_request(Request("a", PROMPT, params, eos_token_id=None))
    out, outs = _step(sched, {}, {"a": _scores(1, 4)})
    assert out.num_scheduled_tokens == {"a": 4} and outs == []
    _step(sched, {}, {"a": _scores(5, 4)})
    # The last chunk also scores token 9 and samples the first output.
    _, outs = _step(sched, {"a": 7}, {"a": _scores(9, 1)}, logprobs={"a": -0.25}, top_logprobs={"a": [(7, -0.25)]})
    (first,) = outs
    assert first.new_token_ids == [7] and first.logprobs == [-0.25] and first.top_logprobs == [[(7, -0.25)]]
    assert first.prompt_logprobs == Logprobs(1, [-float(i) for i in range(1, 10)], [[(i, -0.5)] for i in range(1, 10)])
    _, (second,) = _step(sched, {"a": 8}, {}, logprobs={"a": -1.0}, top_logprobs={"a": [(3, -0.1)]})
    assert second.prompt_logprobs is None and second.top_logprobs == [[(3, -0.1)]]


def test_a_chunk_scored_again_adds_only_what_is_new():
    req = Request("a", PROMPT, SamplingParams(prompt_logprobs=0), eos_token_id=None)
    assert req.add_prompt_logprobs(_scores(1, 6))
    assert req.add_prompt_logprobs(_scores(1, 4))  # recomputed after a preemption: nothing new
    assert req.add_prompt_logprobs(_scores(5, 5))
    assert req.prompt_logprobs == [-float(i) for i in range(1, 10)]
    assert req.take_prompt_logprobs() is not None and req.take_prompt_logprobs() is None


def test_a_gap_in_prompt_logprobs_fails_that_request_alone():
    sched = make(budget=64)
    sched.add_request(Request("gap", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0), eos_token_id=None))
    sched.add_request(Request("ok", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), eos_token_id=None))
    _, outs = _step(sched, {"gap": 1, "ok": 1}, {"gap": _scores(3, 7)})
    by_id = {o.req_id: o for o in outs}
    assert by_id["gap"].finish_reason == "error" and "token 1 was expected" in (by_id["gap"].error or "")
    assert by_id["ok"].finish_reason is None and by_id["ok"].new_token_ids == [1]


def test_prompt_logprobs_skip_the_prefix_cache():
    sched = make(groups=DENSE, prefix=True, budget=64)
    prompt = list(range(1, 18))
    sched.add_request(Request("first", prompt, SamplingParams(max_tokens=1), eos_token_id=None))
    _step(sched, {"first": 1}, {})
    sched.add_request(Request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), eos_token_id=None))
    sched.add_request(Request("hit", prompt, SamplingParams(max_tokens=1), eos_token_id=None))
    out, _ = _step(sched, {"scored": 1, "hit": 1}, {"scored": _scores(1, 16)})
    computed = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
    assert computed == {"scored": 0, "hit": 16}


def test_a_stop_token_id_ends_the_request():
    sched = make()
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(5, 6))
    sched.add_request(Request("s", PROMPT, params, eos_token_id=None))
    _, (first,) = _step(sched, {"s": 4}, {})
    assert first.finish_reason is None
    _, (last,) = _step(sched, {"s": 6}, {})
    assert (last.new_token_ids, last.finish_reason, last.num_output_tokens) == ([6], "stop", 2)
