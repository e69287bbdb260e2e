"""Exact-answer accuracy of a model on its eval set (``eval.jsonl`` in the model directory).

    python -m bench.accuracy --mode local [--model models/tiny-hybrid] [--limit N] [--zero-kv-after-prefill]

Every mode answers the same prompts greedily and is scored by the same code, so the
accuracy of a deployment (colocated, PD) can be compared with the in-process reference.
A mode is one function in ``BACKENDS`` that turns prompts into completions. The last
output line is one JSON object (``mode``, ``model``, ``n``, ``accuracy``, ``seconds``, ...)
for scripts to read.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from models.generate import greedy_generate
from models.loader import load_model

DEFAULT_MODEL = Path("models/tiny-hybrid")

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
            loaded.model, ids[start : start + args.batch_size], max_new_tokens, loaded.eos_token_id,
            zero_kv_after_prefill=args.zero_kv_after_prefill,
        )
        completions += [loaded.tokenizer.decode(out) for out in outputs]
    return completions


BACKENDS: dict[str, Backend] = {"local": complete_local}


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
        "zero_kv_after_prefill": args.zero_kv_after_prefill,
        "n": len(records),
        "correct": correct,
        "accuracy": correct / len(records),
        "seconds": round(seconds, 2),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Exact-answer greedy accuracy on a model's eval.jsonl.")
    parser.add_argument("--mode", required=True, choices=sorted(BACKENDS))
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory holding eval.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N prompts")
    parser.add_argument("--batch-size", type=int, default=50, help="prompts per generate call (local mode)")
    parser.add_argument("--zero-kv-after-prefill", action="store_true",
                        help="zero every attention K/V block after prefill: shows the answers depend on the KV")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(json.dumps(evaluate(args)), flush=True)


if __name__ == "__main__":
    main()
