"""The sampler's vLLM knobs (penalties, min_p, logit bias, min_tokens) against a plain
row-by-row, token-by-token reference on the same logits, and its logprobs and alternatives
against log_softmax of the raw logits."""

from __future__ import annotations

import math

import pytest
import torch

from engine.messages import InvalidRequestError, SamplingParams
from worker.sampler import Sampler, TokenHistory, adjusted_logits, filtered_probs
from worker.token_counts import TokenCounts

V = 40
EOS = 3


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _history(prompts: list[list[int]], outputs: list[list[int]]) -> TokenHistory:
    counts = TokenCounts(V, torch.device("cpu"))
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        counts.add(str(i), prompt, out)
    output_counts, prompt_mask = counts.gather([str(i) for i in range(len(prompts))])
    return TokenHistory(output_counts, prompt_mask, [len(o) for o in outputs], EOS)


def _reference_row(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int]) -> list[float]:
    """vLLM's order, one token at a time: min_tokens, logit bias, repetition, frequency, presence."""
    row = list(logits)
    if len(out) < p.min_tokens:
        for t in [*p.stop_token_ids, *([] if p.ignore_eos else [EOS])]:
            row[t] = -math.inf
    for t, b in p.logit_bias:
        row[t] += b
    for t in range(len(row)):
        if t in prompt or t in out:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * out.count(t)
        row[t] -= p.presence_penalty * (t in out)
    return row


def _sample(logits, params, history=None, logprobs=False, seed=0):
    sampler = Sampler(seed, "cpu", V)
    gens = [sampler.generator_for(p) for p in params]
    return sampler.sample(logits, params, gens, want_logprobs=logprobs, history=history)


PARAMS = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=-0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=0.4, presence_penalty=-0.3),
    SamplingParams(temperature=0.0, logit_bias=((5, 7.5), (9, -100.0))),
    SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(11, 12)),
    SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(11,)),  # reached: nothing masked
    SamplingParams(temperature=0.0, min_tokens=6, ignore_eos=True, stop_token_ids=(13,)),
    SamplingParams(temperature=0.0),
]


def test_penalties_bias_and_min_tokens_equal_the_reference():
    gen = torch.Generator().manual_seed(1)
    logits = _logits(len(PARAMS), seed=2)
    prompts = [torch.randint(0, V, (7,), generator=gen).tolist() for _ in PARAMS]
    outputs = [torch.randint(0, V, (4,), generator=gen).tolist() for _ in PARAMS]
    # The most likely tokens are in the histories, so the penalties change the argmax.
    for r in range(len(PARAMS)):
        outputs[r] += [int(logits[r].argmax())] * 2
    history = _history(prompts, outputs)
    adjusted = adjusted_logits(logits, PARAMS, history)
    for r, p in enumerate(PARAMS):
        want = torch.tensor(_reference_row(logits[r].tolist(), p, prompts[r], outputs[r]))
        assert torch.allclose(adjusted[r], want, atol=1e-5), p
    result = _sample(logits, PARAMS, history, logprobs=True)
    assert result.token_ids == [
        int(torch.tensor(_reference_row(logits[r].tolist(), p, prompts[r], outputs[r])).argmax())
        for r, p in enumerate(PARAMS)
    ]
    # Penalties change the choice of at least the penalized greedy rows; logprobs stay raw.
    assert result.token_ids[:4] != logits[:4].argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    assert result.logprobs == pytest.approx([raw[r, t].item() for r, t in enumerate(result.token_ids)], abs=1e-6)


def test_logit_bias_forces_and_forbids_a_token():
    logits = _logits(4, seed=3)
    forced = [SamplingParams(temperature=1.0, seed=s, logit_bias=((17, 100.0),)) for s in range(4)]
    history = TokenHistory(None, None, [0] * 4, EOS)
    assert _sample(logits, forced, history).token_ids == [17] * 4
    best = logits.argmax(-1).tolist()
    banned = [SamplingParams(temperature=0.0, logit_bias=((t, -100.0),)) for t in best]
    assert all(t != b for t, b in zip(_sample(logits, banned, history).token_ids, best))


def test_min_tokens_keeps_eos_and_stop_ids_out_until_reached():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 50.0
    logits[:, 11] = 40.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(11,))] * 3
    early = _sample(logits, params, TokenHistory(None, None, [0, 2, 3], EOS)).token_ids
    assert early[0] not in (EOS, 11) and early[1] not in (EOS, 11)
    assert early[2] == EOS


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(min_p=0.25)])  # keeps p >= 0.125
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # Against the reference on random rows, with temperature first (as vLLM) and top-k after.
    logits = _logits(6, seed=4)
    params = [SamplingParams(temperature=t, min_p=m, top_k=k) for t, m, k in [(0.5, 0.1, 0), (1.3, 0.3, 5)] * 3]
    got = filtered_probs(logits, params)
    for r, p in enumerate(params):
        scaled = logits[r] / p.temperature
        keep = scaled.softmax(-1) >= p.min_p * scaled.softmax(-1).max()
        if p.top_k:
            keep &= scaled >= scaled.topk(p.top_k).values[-1]
        want = torch.where(keep, scaled, -math.inf).softmax(-1)
        assert torch.allclose(got[r], want, atol=1e-6)


def test_top_logprobs_are_the_raw_log_softmax_top_n():
    logits = _logits(5, seed=5)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=n) for n in (0, 1, 3, 20, 2)]
    result = _sample(logits, params, logprobs=True)
    raw = torch.log_softmax(logits, -1)
    values, ids = raw.topk(20)
    assert result.top_logprobs is not None
    for r in range(5):
        assert [t for t, _ in result.top_logprobs[r]] == ids[r].tolist()
        assert [lp for _, lp in result.top_logprobs[r]] == pytest.approx(values[r].tolist(), abs=1e-6)


def test_a_batch_without_knobs_needs_no_history():
    logits = _logits(3, seed=6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05)]
    assert not any(p.adjusts_logits for p in params)
    _sample(logits[:2], params)
    with pytest.raises(ValueError, match="no history"):
        _sample(logits[:1], [SamplingParams(temperature=0.0, presence_penalty=0.5)])


def test_token_counts_follow_recorded_tokens_and_reuse_rows():
    counts = TokenCounts(V, torch.device("cpu"))
    counts.add("a", [1, 2, 2], [])
    counts.add("b", [4], [7, 7, 8])
    counts.record(["a", "b", "c"], [5, 7, 9])  # "c" has no row: skipped
    counts.record(["a"], [5])
    out, prompt = counts.gather(["b", "c", "a"])
    assert out[0].tolist() == torch.bincount(torch.tensor([7, 7, 8, 7]), minlength=V).tolist()
    assert out[1].sum() == 0 and not prompt[1].any()
    assert out[2].tolist() == torch.bincount(torch.tensor([5, 5]), minlength=V).tolist()
    assert prompt[2].nonzero().flatten().tolist() == [1, 2]
    counts.remove("a")
    counts.add("d", [3], [])
    out, prompt = counts.gather(["d"])
    assert out.sum() == 0 and prompt[0].nonzero().flatten().tolist() == [3]  # a freed row starts clean
    for i in range(10):  # the pool grows
        counts.add(f"x{i}", [i], [i])
    assert counts.gather(["x9"])[0][0, 9] == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("min_p", 1.5),
        ("min_tokens", 17),
        ("top_logprobs", 21),
        ("prompt_logprobs", -1),
        ("stop_token_ids", (-1,)),
        ("logit_bias", ((3, 101.0),)),
        ("logit_bias", ((3, math.nan),)),
    ],
)
def test_validate_names_the_bad_knob(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field
