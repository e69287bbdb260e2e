"""Logprobs and penalties through PD with tensor parallelism on both sides (real Ray, gloo,
NIXL/UCX), served by the ingress's `PDRouter`: the prompt logprobs the TP=2 prefill engine
hands over, the alternatives and the penalized greedy tokens the TP=2 decode engine samples
(every rank counts tokens and samples alike) are transformers' on the same checkpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch

from api.router import Engine, PDRouter
from engine.config import Config
from engine.messages import SamplingParams
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import DEVICE, check_idle, start_pd
from tests.ray_session import stop_actors
from tests.worker.test_logprobs import hf_logprobs, penalized_reference

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="TP=2 on CUDA needs two GPUs"
)

PROMPTS = [[5, 17, 33, 2, 9, 41, 8, 60, 3, 12, 7, 21, 30], [44, 52, 11], [7]]


def test_pd_tp_2_2_logprobs_and_penalties_equal_transformers(ray_cluster, tmp_path):
    hf = save_hf_model("qwen3", tmp_path)
    cfg = Config(
        model=str(tmp_path),
        dtype="float32",
        device=DEVICE,
        block_size=4,
        num_kv_blocks=200,
        max_num_seqs=8,
        max_num_batched_tokens=8,  # the longest prompt is prefilled in two chunks
        worker_threads=1,
        async_scheduling=True,
        prefill=1,
        prefill_tp=2,
        decode_tp=2,
    )
    scored = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=2
    )
    penalized = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.7
    )
    prefill, decode = start_pd(cfg)

    async def main():
        router = PDRouter([Engine.remote("prefill-0", prefill)], [Engine.remote("decode-0", decode)])

        async def run(prompt, sampling, req_id):
            return [out async for out in router.generate(prompt, sampling, req_id)]

        jobs = [run(p, scored, f"s{i}") for i, p in enumerate(PROMPTS)]
        jobs += [run(p, penalized, f"p{i}") for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*jobs)
        await router.close()
        return results

    try:
        results = asyncio.run(main())
        check_idle(prefill, decode)
    finally:
        stop_actors(prefill, decode)
    for prompt, outs in zip(PROMPTS, results[: len(PROMPTS)]):
        assert outs[-1].finish_reason == "length" and outs[-1].error is None
        first = outs[0]
        tokens = [t for o in outs for t in o.new_token_ids]
        want = hf_logprobs(hf, prompt + tokens)
        assert first.prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
        assert first.prompt_logprobs.start == 1
        assert first.prompt_logprobs.logprobs == pytest.approx(
            [want[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-4
        )
        assert [[t for t, _ in top] for top in first.prompt_logprobs.top] == [
            want[i].topk(2).indices.tolist() for i in range(len(prompt) - 1)
        ]
        logprobs = [lp for o in outs for lp in o.logprobs or ()]
        tops = [top for o in outs for top in o.top_logprobs or ()]
        at = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        assert tokens == [int(want[i].argmax()) for i in at]
        assert logprobs == pytest.approx([want[i].max().item() for i in at], abs=1e-4)
        assert [[t for t, _ in top] for top in tops] == [want[i].topk(3).indices.tolist() for i in at]
    for prompt, outs in zip(PROMPTS, results[len(PROMPTS) :]):
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == penalized_reference(hf, prompt, penalized, 8)
