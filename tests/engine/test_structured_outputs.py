"""Structured outputs through a real engine (scheduler, worker, the shipped model): a request
keeps its grammar through preemption and recompute under async scheduling, and one resumed
elsewhere with its earlier outputs as prompt (api/migration.py) goes on exactly as it would have."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from actors.client import EngineCalls, EngineClient
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import RequestOutput, SamplingParams, StructuredOutput

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
EOS = 256
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "pattern": "^[0-9]{3}$"},
        "confident": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["answer", "confident", "tags"],
}
STRUCTURED = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPTS = ["ab=381;qe=027;zt=950;?qe=", "gs=047;tl=517;rf=447;?rf=", "du=947;mk=632;kz=528;ug=369;?ug="]


def _config(num_kv_blocks: int) -> Config:
    return Config(
        model=str(MODEL),
        device="cpu",
        block_size=16,
        num_kv_blocks=num_kv_blocks,
        max_model_len=256,
        max_num_seqs=32,
        max_num_batched_tokens=128,
        async_scheduling=True,
        worker_threads=1,
    )


def _requests(n: int) -> list[tuple[list[int], SamplingParams]]:
    return [
        (list(PROMPTS[i % len(PROMPTS)].encode()), SamplingParams(max_tokens=96, seed=i, structured=STRUCTURED))
        for i in range(n)
    ]


def _serve(cfg: Config, reqs: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[RequestOutput]], object]:
    async def main():
        core, worker = build_local_engine(cfg)
        client = EngineClient(EngineCalls.local(core))

        async def one(i: int, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
            return [out async for out in client.generate(prompt, params, f"r{i}")]

        try:
            outs = await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(reqs)))
            await core.wait_idle()
            return list(outs), core.stats()
        finally:
            await client.close()
            await core.close()
            worker.close()

    return asyncio.run(main())


def _tokens(outs: list[RequestOutput]) -> tuple[list[int], str | None]:
    return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


def _valid(tokens: list[int]) -> None:
    assert tokens[-1] == EOS
    jsonschema.validate(json.loads(bytes(tokens[:-1]).decode()), SCHEMA)


def test_preempted_requests_keep_their_grammar():
    """A tight pool preempts and recomputes requests with steps in flight; each one's seeded
    tokens are those it gets in a roomy pool, and every output is the schema's."""
    reqs = _requests(24)
    roomy, _ = _serve(_config(512), reqs)
    tight, stats = _serve(_config(40), reqs)
    assert stats.extra["preemptions"] > 0
    assert [_tokens(o) for o in tight] == [_tokens(o) for o in roomy]
    for outs in tight:
        tokens, reason = _tokens(outs)
        assert reason == "stop"
        _valid(tokens)


@pytest.mark.parametrize("k", [1, 5, 12])
def test_a_resumed_request_replays_its_outputs_into_its_grammar(k):
    """The engine a request is resumed on is given the outputs already sent as the prompt's
    tail (`num_prior_outputs`), and goes on with the very tokens the first engine would have
    sampled: its matcher is the grammar advanced by them."""
    [(prompt, params)] = _requests(1)
    [whole], _ = _serve(_config(512), [(prompt, params)])
    tokens, reason = _tokens(whole)
    assert reason == "stop" and len(tokens) > k
    resumed = dataclasses.replace(params, max_tokens=params.max_tokens - k, random_offset=k, num_prior_outputs=k)
    [rest], _ = _serve(_config(512), [(prompt + tokens[:k], resumed)])
    assert _tokens(rest) == (tokens[k:], "stop")
    _valid(tokens)
