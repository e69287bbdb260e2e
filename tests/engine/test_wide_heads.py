"""The engine end to end with heads of 64, where a CPU step's attention runs the C++ kernels
and its decode steps the C++ decode stack (docs/design.md §13), dense and with mixtures of
experts: prompts cut into chunks by a small step budget, several chunks and decode tokens in
one step, prefix-cache hits, a tight pool and requests aborted at random points. Every
request left to finish gives the tokens it gives alone, and every block comes back. The other
engine tests' checkpoints have heads of 16, which take SDPA."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.client import EngineCalls, EngineClient
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import SamplingParams
from kernels.cpu import ops as cpu_kernels
from models import decode_stack
from tests.engine.test_core import alone, serve_all, workload
from tests.models.hf_fixtures import save_hf_model
from tests.models.test_decode_stack import CountingStack


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3", "nemotron_h_moe", "qwen3_moe"])
def wide(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}-wide")
    save_hf_model(request.param, path, head_dim=64)
    return str(path)


async def _abort_after(client: EngineClient, prompt: list[int], tokens: int) -> None:
    """Stream a request and walk away after `tokens` tokens (0: before the first): the client
    aborts it, wherever it is in the engine (waiting, mid-prompt, decoding)."""
    got = 0
    async for out in client.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)):
        got += len(out.new_token_ids)
        if got >= tokens:
            return


def _run(cfg: Config, kept, aborted) -> tuple[list[list[int]], list[list[int]], object]:
    async def main():
        core, worker = build_local_engine(cfg)
        client = EngineClient(EngineCalls.local(core))
        try:
            both = await asyncio.gather(serve_all(client, kept), *(_abort_after(client, p, n) for p, n in aborted))
            await core.wait_idle()
            core.scheduler.kv.check_integrity()
            again = await serve_all(client, kept)  # the pages the aborted ones left, reused
            await core.wait_idle()
            core.scheduler.kv.check_integrity()
            return both[0], again, core.stats()
        finally:
            await client.close()
            await core.close()
            worker.close()

    return asyncio.run(main())


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_steps_on_the_kernels_equal_alone(wide, monkeypatch, async_scheduling):
    calls = []
    kernel = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *args: calls.append(1) or kernel(*args))
    stacked = CountingStack(decode_stack.decode)
    monkeypatch.setattr(decode_stack, "decode", stacked)
    rng = random.Random(3)
    kept = workload(12, seed=5, shared_prefix=12)
    aborted = [([rng.randrange(2, 90) for _ in range(rng.randrange(8, 48))], rng.randrange(0, 6)) for _ in range(8)]
    cfg = Config(
        model=wide,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=30,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    first, again, stats = _run(cfg, kept, aborted)
    want = alone(wide, kept)
    assert first == want
    assert again == want
    assert calls, "no step's chunks reached the kernel"
    assert stacked.fused, "no decode step ran on the stack"
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.extra["preemptions"] > 0
