"""raypd's own distance from the machine's limit at real model sizes, without servers: the
in-process engine (engine/local.py, the deployment's scheduler and worker classes) serving one
stream of greedy requests (a 128-token prompt, 32 output tokens by default) on the real-size
random checkpoints of bench.peers_real (bench/peer_models.py `make_real`), against the bounds
bench/machine.py measures on the same cores and threads just before:

- TPOT at 1 stream over (weight bytes a decode step reads / memory read bandwidth);
- TTFT of the prompt over (its FLOPs / fp32 matmul peak).

A quick loop for the work on the kernels and the step (a minute a model, where bench.peers_real
also starts vLLM and HTTP servers); each figure is the best of a few requests, after a warm-up.

    python -m bench.real_step [--models dense,hybrid] [--threads 2] [--work-dir DIR]

prints the CPU line, then one JSON line per model and a last one of the ratios,
`real_<model>_tpot_roofline` and `real_<model>_ttft_roofline`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.machine import cpu_line, measure, model_cost
from bench.peer_models import REAL_BUILDERS, make_real
from engine.config import Config
from engine.core import EngineCore
from engine.local import build_local_engine
from engine.messages import SamplingParams


async def _one(core: EngineCore, prompt: list[int], max_tokens: int) -> list[float]:
    """The seconds from adding one greedy request to each of its tokens' arrival."""
    req_id = f"s{time.monotonic_ns()}"
    start = time.perf_counter()
    core.add_request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    stamps: list[float] = []
    while True:
        for batch in await core.get_outputs(timeout=600):
            for out in batch:
                stamps += [time.perf_counter() - start] * len(out.new_token_ids)
                if out.finish_reason is not None:
                    return stamps


async def engine_figures(
    model: Path, args: argparse.Namespace, before_close: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """Best TTFT and TPOT (seconds) over `args.repeats` requests, after one to warm up.
    `before_close` runs after the last request, while the engine's threads are still alive."""
    torch.set_num_threads(args.threads)
    cfg = Config(
        model=str(model), dtype="float32", device="cpu", max_num_seqs=1, seed=0, worker_cpus=f"0-{args.threads - 1}"
    )
    core, worker = build_local_engine(cfg)
    gen = torch.Generator().manual_seed(0)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    try:
        ttft, tpot = float("inf"), float("inf")
        for i in range(args.repeats + 1):
            prompt = torch.randint(2, vocab - 1, (args.prompt_len,), generator=gen).tolist()
            stamps = await _one(core, prompt, args.max_tokens)
            if i:
                ttft = min(ttft, stamps[0])
                tpot = min(tpot, (stamps[-1] - stamps[0]) / (len(stamps) - 1))
        before_close()
        return ttft, tpot
    finally:
        await core.close()
        worker.close()


def bench_model(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = work / kind  # bench.peers_real's layout: one --work-dir serves both
    make_real(kind, model)
    cost = model_cost(model)
    machine = measure(cost.weight_bytes_per_token, args.threads)
    ttft, tpot = asyncio.run(engine_figures(model, args))
    tpot_bound = cost.tpot_bound_s(machine.bandwidth_bytes_s)
    ttft_bound = cost.ttft_bound_s(args.prompt_len, machine.matmul_peak_flops)
    return {
        "model": kind,
        "bandwidth_gb_s": round(machine.bandwidth_bytes_s / 1e9, 2),
        "matmul_peak_gflop_s": round(machine.matmul_peak_flops / 1e9, 1),
        "tpot_ms": round(tpot * 1e3, 1),
        "tpot_bound_ms": round(tpot_bound * 1e3, 1),
        "tpot_ratio": round(tpot / tpot_bound, 3),
        "ttft_ms": round(ttft * 1e3, 1),
        "ttft_bound_ms": round(ttft_bound * 1e3, 1),
        "ttft_ratio": round(ttft / ttft_bound, 3),
    }


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The in-process engine's options, shared with bench.background."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "raypd-real-step")


def check_engine_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what `add_engine_args` added out of range, by name."""
    if args.threads < 1 or args.max_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
        ap.error("--threads, --prompt-len and --repeats must be at least 1, --max-tokens at least 2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,hybrid", help=f"comma-separated, of {', '.join(REAL_BUILDERS)}")
    add_engine_args(ap)
    args = ap.parse_args()
    kinds = args.models.split(",")
    unknown = [k for k in kinds if k not in REAL_BUILDERS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(REAL_BUILDERS)}")
    check_engine_args(ap, args)
    print(cpu_line(), flush=True)
    ratios: dict[str, float] = {}
    for kind in kinds:
        row = bench_model(kind, args, args.work_dir)
        print(json.dumps(row), flush=True)
        ratios[f"real_{kind}_tpot_roofline"] = row["tpot_ratio"]
        ratios[f"real_{kind}_ttft_roofline"] = row["ttft_ratio"]
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
