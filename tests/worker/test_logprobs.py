"""A worker's logprobs, alternatives and prompt logprobs against transformers' logits on the
same random checkpoint, and its penalties against a reference decode on those logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.messages import SamplingParams
from tests.models.hf_fixtures import save_hf_model
from tests.worker.test_worker import Driver, make_worker

PROMPT = [5, 17, 33, 2, 9, 41, 8, 60, 3, 12, 7]
OTHER = [7, 7, 21, 30, 44]


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3"])
def models(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return save_hf_model(request.param, out), str(out)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids`, fp32."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_over_chunks_equal_transformers(models):
    """Chunked prefill next to a request that asks for none: each chunk scores its own part."""
    hf, path = models
    worker = make_worker(path)
    drv = Driver(worker)
    drv.add("p", PROMPT, SamplingParams(temperature=0.0, prompt_logprobs=4, logprobs=True, top_logprobs=3))
    drv.add("o", OTHER, SamplingParams(temperature=0.0))
    first = drv.step({"p": 4, "o": len(OTHER)})
    second = drv.step({"p": len(PROMPT) - 4})
    assert "o" not in first.prompt_logprobs and "p" not in first.sampled
    runs = [first.prompt_logprobs["p"], second.prompt_logprobs["p"]]
    assert [r.start for r in runs] == [1, 5]
    scored = [lp for r in runs for lp in r.logprobs]
    top = [t for r in runs for t in r.top]
    want = hf_logprobs(hf, PROMPT)
    assert len(scored) == len(PROMPT) - 1
    for i, token in enumerate(PROMPT[1:]):
        assert scored[i] == pytest.approx(want[i, token].item(), abs=1e-4)
        values, ids = want[i].topk(4)
        assert [t for t, _ in top[i]] == ids.tolist()
        assert [lp for _, lp in top[i]] == pytest.approx(values.tolist(), abs=1e-4)
    # The sampled token, from the same forward: its logprob and alternatives at the last position.
    token = second.sampled["p"]
    assert token == int(want[-1].argmax())
    assert second.logprobs["p"] == pytest.approx(want[-1, token].item(), abs=1e-4)
    assert [t for t, _ in second.top_logprobs["p"]] == want[-1].topk(3).indices.tolist()
    # A decode step of it scores no prompt token; the other request's tokens are unchanged.
    third = drv.step({"p": 1, "o": 1})
    assert not third.prompt_logprobs
    assert third.sampled["o"] == int(hf_logprobs(hf, OTHER + drv.reqs["o"].outputs[:1])[-1].argmax())


def test_a_scored_tail_is_scored_by_the_last_row(models):
    """A prefill engine's request: the prompt but its last token, which the last row scores."""
    hf, path = models
    worker = make_worker(path)
    drv = Driver(worker)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    drv.add("t", PROMPT[:-1], params)
    out = drv.build({"t": len(PROMPT) - 1})
    new = dataclasses.replace(out.new_reqs[0], scored_tail=(PROMPT[-1],))
    result = worker.execute_model_sync(dataclasses.replace(out, new_reqs=[new]))
    run = result.prompt_logprobs["t"]
    want = hf_logprobs(hf, PROMPT)
    assert run.start == 1 and len(run.logprobs) == len(PROMPT) - 1
    assert run.logprobs == pytest.approx([want[i, t].item() for i, t in enumerate(PROMPT[1:])], abs=1e-4)


def penalized_reference(hf, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy decode on transformers' logits with vLLM's penalties, one token at a time."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            row = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[prompt + out] = True
        row = torch.where(
            seen, torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty), row
        )
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=row.shape[0]).float()
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        out.append(int(row.argmax()))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
    ],
)
def test_penalized_greedy_decode_equals_the_reference(models, params):
    hf, path = models
    worker = make_worker(path)
    drv = Driver(worker)
    drv.add("g", PROMPT, params)
    drv.add("plain", OTHER, SamplingParams(temperature=0.0))
    drv.step({"g": len(PROMPT), "plain": len(OTHER)})
    drv.decode(["g", "plain"], 7)
    assert drv.reqs["g"].outputs == penalized_reference(hf, PROMPT, params, 8)
    # A request resumed elsewhere with 3 of those tokens as prompt goes on identically: the
    # worker counts them as outputs (`num_prior_outputs`).
    prior = drv.reqs["g"].outputs[:3]
    resumed = dataclasses.replace(params, num_prior_outputs=3)
    drv.add("r", PROMPT + prior, resumed)
    drv.step({"r": len(PROMPT) + 3})
    drv.decode(["r"], 4)
    assert drv.reqs["r"].outputs == drv.reqs["g"].outputs[3:]
