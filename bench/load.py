"""Load generator and report: the real server (Ray Serve, HTTP) under concurrent streaming
completions, for several engine layouts in one run, reported as ratios to the first layout.

    python -m bench.load [--layouts 0x1,1x1] [--requests 200] [--concurrency 32] [--max-tokens 32]
                         [any `python -m serve` flag, e.g. --worker-threads 1]

A layout `PxD` is P prefill and D decode engines (`0xD`: D colocated engines). Prompts are
the shipped model's eval prompts; every request streams exactly `--max-tokens` tokens
(`ignore_eos`), so the layouts do the same work. Client-side timings: time to first token,
inter-token latency, end-to-end latency, and output tokens per second over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from serve import launch
from serve.config import Config
from serve.config import parse_args as parse_serve_args


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    ttft: float
    itls: list[float]
    e2e: float
    tokens: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
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
    return Sample(stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], stamps[-1] - start, tokens)


async def _drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list[Sample], float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def gated(p: str) -> Sample:
            async with gate:
                return await _one(client, model, p, max_tokens)

        await _one(client, model, prompts[0], 2)  # warm-up: first-call costs stay out of the numbers
        start = time.perf_counter()
        samples = await asyncio.gather(*(gated(p) for p in prompts))
        return list(samples), time.perf_counter() - start


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def _report(layout: str, samples: list[Sample], wall: float) -> dict[str, float | str]:
    ttft = [s.ttft for s in samples]
    itl = [x for s in samples for x in s.itls]
    e2e = [s.e2e for s in samples]
    return {"layout": layout, "requests": len(samples), "output_tok_per_s": sum(s.tokens for s in samples) / wall,
            "ttft_p50_ms": 1e3 * _p(ttft, 50), "ttft_p99_ms": 1e3 * _p(ttft, 99),
            "itl_p50_ms": 1e3 * _p(itl, 50), "itl_p99_ms": 1e3 * _p(itl, 99), "e2e_p50_ms": 1e3 * _p(e2e, 50)}


def _layout(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {text!r} is not PxD, e.g. 1x1") from None
    if p < 0 or d < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r} needs P >= 0 prefill and D >= 1 decode engines")
    return p, d


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {low}")
        return value

    return parse


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.description = "Load generator: colocated vs disaggregated layouts through the HTTP server."
    parser.add_argument("--layouts", type=lambda s: [_layout(x) for x in s.split(",")], default=[(0, 1), (1, 1)],
                        help="comma-separated PxD layouts; ratios are against the first (default 0x1,1x1)")
    parser.add_argument("--requests", type=_at_least(1), default=200)
    parser.add_argument("--concurrency", type=_at_least(1), default=32)
    parser.add_argument("--max-tokens", type=_at_least(2), default=32, help="at least 2, to time a token gap")


def main(argv: list[str] | None = None) -> None:
    args = parse_serve_args(argv, extra=_flags)
    base: Config = args.config
    lines = (Path(base.model) / "eval.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    rows = []
    for prefill, decode in args.layouts:
        cfg = dataclasses.replace(base, prefill=prefill, decode=decode, port=_free_port())
        dep = launch.start(cfg, include_dashboard=False, log_to_driver=False)
        try:
            samples, wall = asyncio.run(_drive(dep.url, cfg.model_name, prompts, args.concurrency, args.max_tokens))
        finally:
            launch.stop(dep)
        rows.append(_report(f"{prefill}x{decode}", samples, wall))
    first = rows[0]
    for row in rows:
        row["throughput_ratio"] = row["output_tok_per_s"] / first["output_tok_per_s"]
        row["ttft_p50_ratio"] = row["ttft_p50_ms"] / first["ttft_p50_ms"]
        row["itl_p50_ratio"] = row["itl_p50_ms"] / first["itl_p50_ms"]
        print(f"{row['layout']:>5}  {row['output_tok_per_s']:8.1f} tok/s (x{row['throughput_ratio']:.2f})  "
              f"TTFT p50 {row['ttft_p50_ms']:7.1f} ms (x{row['ttft_p50_ratio']:.2f})  "
              f"ITL p50 {row['itl_p50_ms']:6.1f} ms (x{row['itl_p50_ratio']:.2f})  p99 {row['itl_p99_ms']:6.1f} ms")
    print(json.dumps({"bench": "load", "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                      "rows": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}))


if __name__ == "__main__":
    main()
