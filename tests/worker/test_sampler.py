"""The sampler: greedy is argmax, filters narrow to greedy at their limits, and a seeded
request's draws depend only on its own seed and logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.messages import SamplingParams
from worker.sampler import Sampler, filtered_probs

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(params: list[SamplingParams], logits: torch.Tensor, seed: int = 0, logprobs: bool = False):
    sampler = Sampler(seed, "cpu")
    return sampler.sample(logits, params, [sampler.generator_for(p) for p in params], want_logprobs=logprobs)


def test_greedy_is_argmax_with_unscaled_logprobs():
    logits = _logits(6)
    result = _sample([SamplingParams(temperature=0.0)] * 6, logits, logprobs=True)
    assert result.token_ids == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(result.logprobs), want)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=5, top_p=1e-6),
    ],
)
def test_narrowest_filters_are_greedy(params):
    logits = _logits(8, seed=1)
    for seed in range(3):
        assert _sample([params] * 8, logits, seed=seed).token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(top_k=2), SamplingParams(top_p=0.7)])
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 < 0.7, 0.8 >= 0.7


def test_seeded_request_ignores_its_neighbours():
    logits = _logits(5, seed=2)
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = [_sample([mine], logits[2:3], seed=s).token_ids[0] for s in range(2)]
    crowd = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, seed=99),
    ]
    together = _sample([crowd[0], crowd[1], mine, crowd[2], crowd[3]], logits, seed=7).token_ids[2]
    reordered = _sample([mine, *crowd], torch.cat([logits[2:3], logits[:2], logits[3:]]), seed=3).token_ids[0]
    assert alone[0] == alone[1] == together == reordered


def test_seeded_stream_reproduces_over_many_draws():
    logits = _logits(1, seed=3)
    params = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for _ in range(2):
        sampler = Sampler(0, "cpu")
        gen = sampler.generator_for(params)
        runs.append([sampler.sample(logits, [params], [gen]).token_ids[0] for _ in range(30)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # the stream advances between draws


def test_a_resumed_stream_goes_on_where_it_stopped():
    """A request resumed elsewhere after k tokens (api/migration.py) draws what the k+1-th and
    later draws of an undisturbed stream would have been, with top-k/top-p filtering too."""
    logits = _logits(1, seed=8)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11)
    sampler = Sampler(0, "cpu", V)
    gen = sampler.generator_for(params)
    whole = [sampler.sample(logits, [params], [gen]).token_ids[0] for _ in range(20)]
    resumed = dataclasses.replace(params, random_offset=12)
    gen = sampler.generator_for(resumed)
    rest = [sampler.sample(logits, [resumed], [gen]).token_ids[0] for _ in range(8)]
    assert rest == whole[12:]


def test_unseeded_requests_get_distinct_streams_from_the_worker_seed():
    logits = _logits(1, seed=4).expand(40, V)
    params = [SamplingParams(temperature=1.0)] * 40
    first, again, other = (_sample(params, logits, seed=s).token_ids for s in (0, 0, 1))
    assert first == again
    assert first != other
    assert len(set(first)) > 1


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = torch.log(probs)[None].expand(4000, 4)
    tokens = _sample([SamplingParams(temperature=1.0)] * 4000, logits, seed=11).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert (freq - probs).abs().max() < 0.03
    hot = _sample([SamplingParams(temperature=2.0)] * 4000, logits, seed=11).token_ids
    # A higher temperature flattens the distribution: the top token loses mass.
    assert hot.count(0) / 4000 < freq[0] - 0.1


def test_nan_logits_do_not_raise():
    logits = torch.full((2, V), float("nan"))
    result = _sample([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)], logits)
    assert len(result.token_ids) == 2


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    params = [SamplingParams(temperature=1e-40)]
    result = Sampler(0, "cpu").sample(logits, params, [None])
    assert params[0].greedy and result.token_ids == [1]
