"""Exact-answer accuracy of a model on its eval set (``eval.jsonl`` in the model directory).

    python -m bench.accuracy --mode local [--model models/tiny-hybrid] [--limit N] [--zero-kv-after-prefill]
    python -m bench.accuracy --mode colocated|pd [any `python -m serve` flag, e.g. --worker-threads 1]
    python -m bench.accuracy --mode pd --prefill-tp 2 --decode-tp 1   # tensor-parallel engines

`local` runs the model in this process (models.reference); `colocated` and `pd` run the real
engines as Ray actors (pd: prefill and decode engines moving KV over NIXL, routed as the API
server routes), configured by the same flags as `python -m serve`: on the Ray session this
process already has (tests), else on a local cluster started for the run and stopped after it.

Every mode answers the same prompts greedily and is scored by the same code, so the
accuracy of a deployment (colocated, PD) can be compared with the in-process reference.
A mode is one function in ``BACKENDS`` that turns prompts into completions. The last
output line is one JSON object (``mode``, ``model``, ``n``, ``accuracy``, ``seconds``, ...)
for scripts to read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from tokenizers import Tokenizer

from api.router import Engine, PDRouter, RoundRobinRouter, Router
from engine.config import Config
from engine.messages import SamplingParams
from models.loader import load_model
from models.model_files import load_config, load_generation_config
from models.reference import greedy_generate
from serve.config import parse_args as parse_serve_args
from serve.engines import NAMESPACE, start_engines, stop_engines

# (args, prompts, max_new_tokens) -> completions, EOS excluded.
Backend = Callable[[argparse.Namespace, list[str], int], list[str]]


def load_eval(model_dir: Path, limit: int | None) -> list[dict[str, str]]:
    lines = (model_dir / "eval.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return records[:limit] if limit is not None else records


def complete_local(args: argparse.Namespace, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The reference: the model in this process, in its checkpoint dtype, over the paged cache."""
    loaded = load_model(args.model)
    ids = [loaded.tokenizer.encode(p).ids for p in prompts]
    completions: list[str] = []
    for start in range(0, len(ids), args.batch_size):
        outputs = greedy_generate(
            loaded.model,
            ids[start : start + args.batch_size],
            max_new_tokens,
            loaded.eos_token_id,
            zero_kv_after_prefill=args.zero_kv_after_prefill,
        )
        completions += [loaded.tokenizer.decode(out) for out in outputs]
    return completions


def complete_engines(args: argparse.Namespace, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The deployment: engine actors on a local Ray cluster, requests routed as the ingress does."""
    cfg: Config = args.config
    if args.mode == "pd" and cfg.colocated:
        cfg = dataclasses.replace(cfg, prefill=1)
    elif args.mode == "colocated":
        cfg = dataclasses.replace(cfg, prefill=0, prefill_tp=None, decode_tp=None)
    tokenizer = Tokenizer.from_file(str(Path(cfg.model) / "tokenizer.json"))
    own_cluster = not ray.is_initialized()
    if own_cluster:
        ray.init(
            address="local",
            namespace=NAMESPACE,
            num_cpus=max(8, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.getLevelNamesMapping()[cfg.log_level],
        )
    engines: dict[str, object] = {}
    try:
        names = start_engines(cfg, engines)

        def of(role: str) -> list[Engine]:
            return [Engine.remote(n, engines[n]) for n in names[role]]

        router: Router = PDRouter(of("prefill"), of("decode")) if names["prefill"] else RoundRobinRouter(of("decode"))
        outputs = asyncio.run(_generate_all(router, [tokenizer.encode(p).ids for p in prompts], max_new_tokens))
    finally:
        stop_engines(list(engines))
        if own_cluster:
            ray.shutdown()
    _, eos = load_generation_config(cfg.model, load_config(cfg.model))
    return [tokenizer.decode([t for t in out if t != eos]) for out in outputs]


async def _generate_all(router: Router, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)

    async def one(i: int, ids: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in router.generate(ids, sampling, f"acc-{i}"):
            if out.finish_reason == "error":
                raise RuntimeError(f"prompt {i} failed: {out.error}")
            tokens += out.new_token_ids
        return tokens

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await router.close()


BACKENDS: dict[str, Backend] = {"local": complete_local, "colocated": complete_engines, "pd": complete_engines}


def evaluate(args: argparse.Namespace) -> dict[str, object]:
    """Score ``args.mode`` on the eval set: an answer counts only if the completion equals it
    exactly and then stops, so the token budget is the longest answer plus one for EOS."""
    records = load_eval(args.model, args.limit)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    max_new_tokens = max(len(tokenizer.encode(r["answer"]).ids) for r in records) + 1
    start = time.monotonic()
    completions = BACKENDS[args.mode](args, [r["prompt"] for r in records], max_new_tokens)
    seconds = time.monotonic() - start
    correct = sum(c == r["answer"] for c, r in zip(completions, records, strict=True))
    return {
        "mode": args.mode,
        "model": str(args.model),
        "debug_zero_loaded_blocks": args.config.debug_zero_loaded_blocks,
        "debug_stream_delay_ms": args.config.debug_stream_delay_ms,
        "zero_kv_after_prefill": args.zero_kv_after_prefill,
        "tp": {role: args.config.tp_size(role) for role in ("colocated", "prefill", "decode")},
        "n": len(records),
        "correct": correct,
        "accuracy": correct / len(records),
        "seconds": round(seconds, 2),
    }


def _bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.description = "Exact-answer greedy accuracy on a model's eval.jsonl."
    parser.add_argument("--mode", required=True, choices=sorted(BACKENDS))
    parser.add_argument("--limit", type=int, default=None, help="score only the first N prompts")
    parser.add_argument("--batch-size", type=int, default=50, help="prompts per generate call (local mode)")
    parser.add_argument(
        "--zero-kv-after-prefill",
        action="store_true",
        help="local mode: zero every attention K/V block after prefill (the answers need the KV)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parse_serve_args(argv, extra=_bench_flags)
    args.model = Path(args.config.model)
    if args.zero_kv_after_prefill and args.mode != "local":
        raise SystemExit("--zero-kv-after-prefill applies to --mode local only")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(json.dumps(evaluate(args)), flush=True)


if __name__ == "__main__":
    main()
