"""Load test and report: streaming completions against the real HTTP server, reported in
`vllm bench serve` terms, with the server's own prefill/decode breakdown from `/metrics`.

    python -m bench.load --url http://HOST:8000 [--requests 500] [--concurrency 32] [--out PREFIX]
    python -m bench.load [--layouts 0x1,1x1] [--requests 200] [any `python -m serve` flag]
    python -m bench.load --layouts 2x2 --workload shared-prefix --compare router=round_robin,cache_aware

With `--url` it drives a running server (a cluster deployment, a `ray job submit` job). Without,
it starts each layout `PxD` (P prefill and D decode engines; `0xD`: D colocated engines) on a
local cluster in turn and compares them as ratios to the first; `--compare FIELD=A,B` runs each
layout once per value of one config field (a router, a threshold) and checks that every run
gave the same outputs. Prompts are the model's eval prompts (`--model DIR`/eval.jsonl), or token
ids from `--workload` (bench/workloads.py); every request streams exactly `--max-tokens` tokens
(`ignore_eos`), so runs do the same work. Writes PREFIX.json (every number) and PREFIX.png
(latency CDFs, throughput over time) and prints one line per run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from actors.ports import free_port
from bench.client import LoadSpec, Sample, run_load, warm_up
from bench.load_plot import plot_runs
from bench.server_metrics import breakdown, pd_decisions, wait_idle
from bench.stats import Slo, summarize
from bench.workloads import shared_prefix, short_long, systems_and_chats
from engine.config import FIELDS, Config, ConfigError
from serve import launch
from serve.config import parse_args as parse_serve_args

IDLE_TIMEOUT_S = 60.0
SHORT_PROMPT_TOKENS = 64  # a run with prompts on both sides also reports the short ones' TTFT


def _served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=10).raise_for_status().json()["data"]
    return models[0]["id"]


def measure(url: str, spec: LoadSpec, slo: Slo, label: str) -> tuple[dict[str, Any], list[Sample], float]:
    """One run against `url`: the client's summary plus the server's per-engine breakdown."""
    warm = asyncio.run(warm_up(url, spec))
    if not warm.ok:
        raise RuntimeError(f"the server at {url} failed a first request ({warm.error})")
    before = wait_idle(url, spec.api_key, IDLE_TIMEOUT_S)
    with tqdm(total=len(spec.prompts), desc=label, unit="req", file=sys.stderr, leave=False) as bar:
        samples, wall = asyncio.run(run_load(url, spec, lambda s: bar.update()))
    after = wait_idle(url, spec.api_key, IDLE_TIMEOUT_S)
    server = breakdown(before, after)
    report = {
        "label": label,
        **summarize(samples, wall, slo, len(spec.prompts)),
        "prefix_cache_hit_tokens": sum(row["prefix_cache_hits"] for row in server.values()),
        "pd_decisions": pd_decisions(url, spec.api_key),
        "server": server,
    }
    short = [s.ttft for s in samples if s.ok and s.prompt_tokens <= SHORT_PROMPT_TOKENS]
    if short and len(short) < len([s for s in samples if s.ok]):
        report["median_short_ttft_ms"] = 1e3 * statistics.median(short)
    return report, samples, wall


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['label']:>8}  {r['completed']}/{r['num_prompts']} ok, {r['failed']} failed  "
        f"{r['request_throughput']:6.2f} req/s  {r['output_throughput']:8.1f} tok/s  "
        f"goodput {r['request_goodput']:6.2f} req/s  TTFT p50 {r['median_ttft_ms']:7.1f} ms  "
        f"TPOT p50 {r['median_tpot_ms']:6.1f} ms  ITL p99 {r['p99_itl_ms']:7.1f} ms  "
        f"prefix hits {r['prefix_cache_hit_tokens']:.0f} tok"
        + (f"  short TTFT p50 {r['median_short_ttft_ms']:7.1f} ms" if "median_short_ttft_ms" in r else "")
        + (f"  outputs equal {r['outputs_equal_to_first']}" if "outputs_equal_to_first" in r else "")
    )


def _compare(text: str) -> tuple[str, list[Any]]:
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in FIELDS or not values:
        raise argparse.ArgumentTypeError(f"--compare {text!r} is not FIELD=VALUE,VALUE with FIELD a config field")
    return name, [yaml.safe_load(v) for v in values.split(",")]


def _layout(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {text!r} is not PxD, e.g. 1x1") from None
    if p < 0 or d < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r} needs P >= 0 prefill and D >= 1 decode engines")
    return p, d


def _at_least(low: float, kind: Callable[[str], float] = int) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {low}")
        return value

    return parse


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.description = "Load test of the OpenAI-compatible endpoint, reported in `vllm bench serve` terms."
    parser.add_argument("--url", help="drive this running server instead of starting layouts locally")
    parser.add_argument(
        "--layouts",
        type=lambda s: [_layout(x) for x in s.split(",")],
        default=[(0, 1), (1, 1)],
        help="without --url: comma-separated PxD layouts; ratios are against the first (default 0x1,1x1)",
    )
    parser.add_argument(
        "--compare",
        type=_compare,
        help="without --url: run each layout once per value of one config field, e.g. router=round_robin,cache_aware",
    )
    parser.add_argument(
        "--workload",
        choices=("eval", "shared-prefix", "short-long", "systems-and-chats"),
        default="eval",
        help="the model's eval prompts, or token ids: system prompts shared by many requests, short and long "
        "prompts mixed, or system prompts then multi-turn chats (bench/workloads.py)",
    )
    parser.add_argument("--requests", type=_at_least(1), default=200)
    parser.add_argument("--concurrency", type=_at_least(1), default=32)
    parser.add_argument("--max-tokens", type=_at_least(2), default=32, help="at least 2, to time a token gap")
    parser.add_argument("--goodput-ttft-ms", type=_at_least(0, float), default=2000.0)
    parser.add_argument("--goodput-tpot-ms", type=_at_least(0, float), default=100.0)
    parser.add_argument(
        "--max-duration-s",
        type=_at_least(1, float),
        default=1800.0,
        help="no request starts after this many seconds of a run",
    )
    parser.add_argument("--request-timeout-s", type=_at_least(1, float), default=300.0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results/load"),
        help="writes OUT.json and OUT.png (default bench/results/load)",
    )


def _prompts(workload: str, model: Path, n: int) -> list[str | list[int]]:
    if workload == "eval":
        lines = (model / "eval.jsonl").read_text().splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
        return [texts[i % len(texts)] for i in range(n)]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    makers: dict[str, Callable[[int, int], list[list[int]]]] = {
        "shared-prefix": shared_prefix,
        "short-long": short_long,
        "systems-and-chats": systems_and_chats,
    }
    return list(makers[workload](n, vocab))


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except (httpx.HTTPError, RuntimeError) as e:  # a server that is not there, or not well
        print(f"bench.load: {e}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None) -> int:
    args = parse_serve_args(argv, extra=_flags)
    base: Config = args.config
    key = base.api_keys[0] if base.api_keys else None  # any one of the server's keys will do
    prompts = _prompts(args.workload, Path(base.model), args.requests)
    slo = Slo(args.goodput_ttft_ms, args.goodput_tpot_ms)

    def spec(model: str) -> LoadSpec:
        return LoadSpec(
            model, prompts, args.max_tokens, args.concurrency, args.max_duration_s, args.request_timeout_s, key
        )

    runs, reports = [], []
    if args.url:
        url = args.url.rstrip("/")
        report, samples, wall = measure(url, spec(_served_model(url, key)), slo, "server")
        reports.append(report)
        runs.append(("server", samples, wall))
    else:
        field, values = args.compare or (None, [None])
        for prefill, decode in args.layouts:
            for value in values:
                changed: dict[str, Any] = {field: value} if field else {}
                try:
                    cfg = dataclasses.replace(base, prefill=prefill, decode=decode, port=free_port(), **changed)
                except ConfigError as e:
                    print(f"bench.load: --compare: {e}", file=sys.stderr)
                    return 2
                label = f"{prefill}x{decode}" + (f" {field}={value}" if field else "")
                dep = launch.start(cfg, include_dashboard=False, log_to_driver=False)
                try:
                    report, samples, wall = measure(dep.url, spec(cfg.model_name), slo, label)
                finally:
                    launch.stop(dep)
                reports.append(report)
                runs.append((label, samples, wall))
                outputs = {s.index: s.text for s in samples if s.ok}
                if runs[0][0] != label:
                    baseline = {s.index: s.text for s in runs[0][1] if s.ok}
                    same = [i for i in outputs if i in baseline and outputs[i] == baseline[i]]
                    report["outputs_equal_to_first"] = f"{len(same)}/{len(outputs)}"
        first = reports[0]
        for r in reports:
            r["output_throughput_ratio"] = r["output_throughput"] / first["output_throughput"]
            r["median_ttft_ratio"] = r["median_ttft_ms"] / first["median_ttft_ms"]
            r["median_itl_ratio"] = r["median_itl_ms"] / first["median_itl_ms"]
    for r in reports:
        print(_line(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "load",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "runs": reports,
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot_runs(runs, args.out.with_suffix(".png"))
    print(f"report: {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}", flush=True)
    return 0 if all(r["failed"] == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
