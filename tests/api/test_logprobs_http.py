"""Logprobs, echo and the sampling knobs over real HTTP (Ray Serve, the `openai` package),
colocated and 1P1D, against transformers on the same checkpoint. Under PD the prompt's
logprobs come from the prefill engine's forward with its hand-over; the numbers must be the
colocated ones, and both transformers'."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.client import EngineCalls, EngineClient
from actors.ports import free_port
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import SamplingParams
from tests.api.conftest import deployed
from tests.worker.test_logprobs import hf_logprobs, penalized_reference

KEY = "sk-test"
MODEL = "tiny"
IDS = [3, 14, 15, 92, 65, 35, 8, 9, 79]
TEXT = " ".join(f"t{i}" for i in IDS)
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module", params=[0, 1], ids=["colocated", "1P1D"])
def server(ray_cluster, checkpoint, request):
    cfg = Config(
        model=checkpoint,
        served_model_name=MODEL,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=4,  # every prompt here is prefilled in chunks
        worker_threads=1,
        api_key=KEY,
        port=free_port(),
        prefill=request.param,
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def test_echo_with_logprobs_is_transformers_prompt_logprobs(client, hf):
    """What lm-eval's loglikelihood sends: token ids, echo, logprobs=1, max_tokens=1."""
    r = client.completions.create(model=MODEL, prompt=IDS, echo=True, logprobs=1, max_tokens=1, **GREEDY)
    choice = r.choices[0]
    want = hf_logprobs(hf, IDS)
    lp = choice.logprobs
    assert choice.text.startswith(TEXT)
    assert lp.tokens[: len(IDS)] == [f"t{i}" for i in IDS]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate(IDS[1:], start=1):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, token].item(), abs=1e-4)
        best = int(want[i - 1].argmax())
        assert lp.top_logprobs[i][f"t{best}"] == pytest.approx(want[i - 1, best].item(), abs=1e-4)
        assert lp.top_logprobs[i][f"t{token}"] == pytest.approx(lp.token_logprobs[i])
    # The generated token follows, with its own logprob; offsets run over prompt and output.
    assert len(lp.tokens) == len(IDS) + 1
    assert lp.token_logprobs[-1] == pytest.approx(want[-1].max().item(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(IDS), 1)


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, hf):
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0, **GREEDY)
    choice = r.choices[0]
    assert choice.text == TEXT
    assert len(choice.logprobs.tokens) == len(IDS)
    want = hf_logprobs(hf, IDS)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [want[i, t].item() for i, t in enumerate(IDS[1:])], abs=1e-4
    )
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs[1:])
    assert r.usage.completion_tokens == 0


def test_vllm_prompt_logprobs_by_token_id(http, hf):
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": IDS, "max_tokens": 2, "prompt_logprobs": 3, **GREEDY}
    )
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    want = hf_logprobs(hf, IDS)
    assert entries[0] is None and len(entries) == len(IDS)
    for i, token in enumerate(IDS[1:], start=1):
        entry = entries[i]
        assert entry[str(token)]["logprob"] == pytest.approx(want[i - 1, token].item(), abs=1e-4)
        assert entry[str(token)]["decoded_token"] == f"t{token}"
        assert set(map(int, entry)) >= set(want[i - 1].topk(3).indices.tolist())


def test_chat_top_logprobs_whole_and_streamed(client):
    messages = [{"role": "user", "content": TEXT}]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 4, **GREEDY}
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 4
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert (tops[0].token, tops[0].logprob) == (entry.token, pytest.approx(entry.logprob))  # greedy
        assert tops[0].bytes == list(tops[0].token.encode())
    streamed = [
        e
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_completion_top_logprobs_streamed_equal_whole(client):
    kw = {"model": MODEL, "prompt": TEXT, "max_tokens": 5, "logprobs": 3, **GREEDY}
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert [t for c in chunks for t in c.top_logprobs] == whole.top_logprobs
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset
    assert all(len(top) == 3 for top in whole.top_logprobs)  # the greedy token is among its top 3


def test_greedy_penalties_equal_the_reference(client, hf):
    extra = {"repetition_penalty": 1.6, "ignore_eos": True}
    r = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=10, frequency_penalty=0.8, presence_penalty=0.4, extra_body=extra, **GREEDY
    )
    want = penalized_reference(
        hf, IDS, SamplingParams(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.4), 10
    )
    assert r.choices[0].text.split() == [f"t{i}" for i in want]
    plain = client.completions.create(model=MODEL, prompt=IDS, max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    assert plain.choices[0].text != r.choices[0].text  # the penalties changed the output


def in_process(cfg: Config, prompt: list[int], sampling: SamplingParams) -> list[int]:
    """The same request on an in-process colocated engine built from the same config."""

    async def main():
        core, worker = build_local_engine(dataclasses.replace(cfg, prefill=0))
        client = EngineClient(EngineCalls.local(core))
        ids = [t async for out in client.generate(prompt, sampling) for t in out.new_token_ids]
        await client.close()
        await core.close()
        worker.close()
        return ids

    return asyncio.run(main())


def test_seeded_sampling_with_every_knob_equals_the_in_process_engine(server, client):
    """Sampled, seeded: the draw depends only on the request's seed and its own adjusted logits,
    so the served tokens (through a prefill and a decode engine under PD) are the colocated ones."""
    knobs = {"repetition_penalty": 1.3, "min_p": 0.02, "min_tokens": 5, "stop_token_ids": [11], "ignore_eos": True}
    r = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        presence_penalty=0.6,
        frequency_penalty=0.3,
        logit_bias={"40": 3.0, "41": -100},
        extra_body=knobs,
    )
    sampling = SamplingParams(
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        ignore_eos=True,
        presence_penalty=0.6,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        min_p=0.02,
        min_tokens=5,
        stop_token_ids=(11,),
        logit_bias=((40, 3.0), (41, -100.0)),
    )
    want = in_process(server.cfg, IDS, sampling)
    shown = [t for t in want if t != 11]  # a stop token id shows no text
    assert r.choices[0].text.split() == [f"t{t}" for t in shown]
    assert r.usage.completion_tokens == len(want) >= 5 and 41 not in want


def test_logit_bias_stop_token_ids_and_min_tokens(client):
    forced = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, logit_bias={"7": 100}, **GREEDY)
    assert forced.choices[0].text.split() == ["t7"] * 4
    # t7 forced, and a stop token: it ends the output, its text is not shown, usage counts it.
    stopped = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=8, logit_bias={"7": 100}, extra_body={"stop_token_ids": [7]}, **GREEDY
    )
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("", "stop")
    assert stopped.usage.completion_tokens == 1
    # min_tokens keeps the stop token out until 3 tokens are out.
    later = client.completions.create(
        model=MODEL,
        prompt=TEXT,
        max_tokens=8,
        logit_bias={"7": 100},
        extra_body={"stop_token_ids": [7], "min_tokens": 3},
        **GREEDY,
    )
    assert later.choices[0].finish_reason == "stop" and later.usage.completion_tokens == 4
    assert "t7" not in later.choices[0].text.split()


def test_min_tokens_holds_back_stop_strings_too(client):
    """As vLLM: a stop string counts only in the text after the first `min_tokens` outputs."""
    kw = {"model": MODEL, "prompt": TEXT, "max_tokens": 8, "logit_bias": {"7": 100}, "stop": "t7", **GREEDY}
    early = client.completions.create(**kw)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    for stream in (False, True):
        later = client.completions.create(stream=stream, extra_body={"min_tokens": 3}, **kw)
        if stream:
            chunks = list(later)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = later.choices[0].text, later.choices[0].finish_reason
            assert later.usage.completion_tokens == 4  # the engine stopped on the fourth t7
        assert (text.split(), finish) == (["t7"] * 3, "stop")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "t1", "logit_bias": {"96": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "t1", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "t1", "logit_bias": {"3": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "t1", "stop_token_ids": [500]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "t1", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "t1", "frequency_penalty": "1"}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "t1", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "t1", "min_p": 1.1}, "min_p"),
        ("/v1/completions", {"prompt": "t1", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"prompt": "t1", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "t1", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "t1", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "t1"}], "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
    ],
)
def test_bad_knobs_are_400_naming_the_field(http, path, body, param):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
