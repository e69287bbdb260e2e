"""The load generator's HTTP side: streaming completions against an OpenAI-compatible server,
each timed token by token, with failures kept (by kind) instead of raised.

Bounded: at most `requests` requests, none started after `duration_s`, each cut off after
`request_timeout_s`; the stream of one request ends with the server's `[DONE]` or the cut-off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it; times in seconds from the run's start."""

    start: float
    ok: bool
    error: str = ""  # the failure's kind: http_503, timeout, connect, stream_error, no_tokens, ...
    ttft: float = 0.0
    token_times: tuple[float, ...] = field(default=(), repr=False)  # arrival of each text chunk
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    index: int = -1  # which of the spec's prompts
    text: str = field(default="", repr=False)  # the whole output, to compare runs

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """vLLM's time per output token: the decode time spread over the tokens after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True, slots=True)
class LoadSpec:
    model: str
    prompts: Sequence[str | list[int]]  # text, or token ids
    max_tokens: int
    concurrency: int
    duration_s: float
    request_timeout_s: float
    api_key: str | None = None


async def _one(
    client: httpx.AsyncClient, spec: LoadSpec, prompt: str | list[int], t0: float, index: int = -1
) -> Sample:
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    texts: list[str] = []
    usage: dict[str, int] = {}

    def failed(kind: str) -> Sample:
        return Sample(start - t0, False, kind, index=index)

    try:
        async with asyncio.timeout(spec.request_timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return failed(f"http_{r.status_code}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return failed("stream_error")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        stamps.append(time.perf_counter())
                        texts.append(chunk["choices"][0]["text"])
    except TimeoutError:
        return failed("timeout")
    except httpx.ConnectError:
        return failed("connect")
    except httpx.HTTPError as e:
        return failed(type(e).__name__)
    if not stamps:
        return failed("no_tokens")
    return Sample(
        start - t0,
        True,
        "",
        stamps[0] - start,
        tuple(s - t0 for s in stamps),
        stamps[-1] - start,
        usage.get("prompt_tokens", 0),
        usage.get("completion_tokens", len(stamps)),
        index,
        "".join(texts),
    )


def _client(url: str, spec: LoadSpec) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=spec.request_timeout_s, limits=limits)


async def warm_up(url: str, spec: LoadSpec) -> Sample:
    """One short request, so first-call costs (connections, lazy imports) stay out of the numbers."""
    async with _client(url, spec) as client:
        return await _one(client, dataclasses.replace(spec, max_tokens=2), spec.prompts[0], time.perf_counter())


async def run_load(
    url: str, spec: LoadSpec, on_done: Callable[[Sample], None] = lambda s: None
) -> tuple[list[Sample], float]:
    """Send every prompt once, `concurrency` at a time; returns the samples (in completion order)
    and the run's wall time. Prompts not started within `duration_s` are not sent at all."""
    samples: list[Sample] = []
    async with _client(url, spec) as client:
        t0 = time.perf_counter()
        queue = iter(enumerate(spec.prompts))

        async def user() -> None:
            for index, prompt in queue:  # shared iterator: each prompt goes to exactly one user
                if time.perf_counter() - t0 > spec.duration_s:
                    return
                sample = await _one(client, spec, prompt, t0, index)
                samples.append(sample)
                on_done(sample)

        await asyncio.gather(*(user() for _ in range(spec.concurrency)))
        return samples, time.perf_counter() - t0
