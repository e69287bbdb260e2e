"""The streaming client bench.peers drives both servers with: the same requests, one warm-up
request first, token-id prompts allowed. Simpler than bench.client's, which also classifies
failures and bounds every wait: a peer comparison run must not tolerate failures at all."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time

import httpx


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    ttft: float
    itls: list[float]
    e2e: float
    tokens: int


async def one(client: httpx.AsyncClient, model: str, prompt: str | list[int], max_tokens: int) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("a request streamed no text")
    return Sample(stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)], stamps[-1] - start, tokens)


async def drive(
    url: str, model: str, prompts: list[str] | list[list[int]], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def gated(p: str | list[int]) -> Sample:
            async with gate:
                return await one(client, model, p, max_tokens)

        # Warm-up: first-call costs stay out of the numbers. Its prompt is the first one reversed,
        # so that no measured request finds it in a prefix cache (a hit would skip the prefill).
        await one(client, model, prompts[0][::-1], 2)
        start = time.perf_counter()
        samples = await asyncio.gather(*(gated(p) for p in prompts))
        return list(samples), time.perf_counter() - start
