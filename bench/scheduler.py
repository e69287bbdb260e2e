"""Micro-benchmark of `Scheduler.schedule()`: microseconds per call at 1, 64 and 256 running
requests, with the zero bookkeeping on (a hybrid model: new attention blocks recorded,
drained and filtered every step) and off (the same scheduler with the zero list dropped).
Ratios are against the "off" run measured in the same process.

Then the share of a whole decode step that is scheduling: a real scheduler and a real
in-process worker with `--model` (the shipped hybrid by default), every request decoding,
steps run one after another: scheduling (`schedule` + `update_from_output`) over the
whole step (scheduling + the worker's `execute_model`). The block size is the one the engine
picks for the model (48 tokens for the shipped hybrid) unless `--share-block-size` says
otherwise, and a run lasts two blocks' worth of decode steps (at least `--share-steps`), so the
steps where every request crosses into a new block come at the rate they do in serving; the
share at 256 with 16-token blocks (three times as many crossings) is measured as well.

    python -m bench.scheduler [--steps 300] [--block-size 4] [--share-steps 30] [--share-block-size N]
                              [--model DIR] [--json-out FILE]

The last line is JSON: `sched_share_256`, the share at 256 running requests at the engine's
block size, and `sched_share_256_block16`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from actors.process import freeze_startup_objects
from engine.messages import ModelRunnerOutput, SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.cache_group import CacheGroup, cdiv
from kv.kv_cache_manager import KVCacheManager
from worker.config import WorkerConfig
from worker.worker import Worker

GROUPS = (CacheGroup("attention", (1, 4)), CacheGroup("mamba", (0, 3)))


class _NoZeroScheduler(Scheduler):
    """The baseline: new block ids are drained but never become a zero list."""

    def _get_new_block_ids_to_zero(self, step: int) -> list[int] | None:
        self.kv.take_blocks_to_zero()
        return None


def _measure(cls: type[Scheduler], running: int, steps: int, block_size: int) -> float:
    blocks_per_req = cdiv(16 + steps + 8, block_size) + 1
    kv = KVCacheManager(GROUPS, running * blocks_per_req + 8, block_size, enable_prefix_caching=False)
    sched = cls(SchedulerConfig(max(running, 1) * 16 + 16, running, 1 << 20), kv, StopChecker(None, 1 << 20))
    for i in range(running):
        sched.add_request(Request(f"r{i}", list(range(1, 17)), SamplingParams(max_tokens=steps + 4), None))
    elapsed = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        elapsed += time.perf_counter() - t0
        assert out is not None
        sched.update_from_output(out, ModelRunnerOutput(out.step_id, {r: 7 for r in out.num_scheduled_tokens}))
    return elapsed / steps * 1e6


def _engine_block_size(model: Path, dtype: str, device: str) -> int:
    """The block size the engine picks for the model (a worker with a one-block cache)."""
    probe = Worker(WorkerConfig(str(model), dtype=dtype, device=device, num_kv_blocks=1))
    try:
        return probe.layout.block_size
    finally:
        probe.close()


def _share(model: Path, running: int, steps: int, block_size: int, dtype: str, device: str) -> tuple[float, float]:
    """(scheduling, whole step) in microseconds per decode step at `running` requests."""
    prompt_len = 16
    blocks = running * (cdiv(prompt_len + steps + 4, block_size) + 1) + 8
    worker = Worker(WorkerConfig(str(model), dtype=dtype, device=device, block_size=block_size, num_kv_blocks=blocks))
    layout = worker.layout
    freeze_startup_objects()  # as the worker actor does
    try:
        kv = KVCacheManager(layout.groups, layout.num_blocks, layout.block_size, enable_prefix_caching=False)
        sched = Scheduler(
            SchedulerConfig(max(running * prompt_len, 2048), running, 1 << 20), kv, StopChecker(None, 1 << 20)
        )
        for i in range(running):
            prompt = [(i * 7 + j) % 200 + 1 for j in range(prompt_len)]
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 4), None))
        sched_s = step_s = 0.0
        for step in range(steps + 1):  # step 0 is the prefill of every prompt
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            assert out is not None
            result = worker.execute_model_sync(out)
            t2 = time.perf_counter()
            sched.update_from_output(out, result)
            t3 = time.perf_counter()
            if step:
                assert len(out.num_scheduled_tokens) == running and sum(out.num_scheduled_tokens.values()) == running
                sched_s += (t1 - t0) + (t3 - t2)
                step_s += t3 - t0
    finally:
        worker.close()
    return sched_s / steps * 1e6, step_s / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--share-steps", type=int, default=30, help="at least this many decode steps per share")
    ap.add_argument(
        "--share-block-size", type=int, help="tokens per KV block for the shares; default: the engine's choice"
    )
    ap.add_argument("--model", type=Path, default=Path(__file__).resolve().parent.parent / "models" / "tiny-hybrid")
    ap.add_argument("--dtype", default="auto", help="the worker's dtype, as `python -m serve --dtype`")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the worker's device")
    ap.add_argument("--json-out", type=Path, help="also write every row here")
    args = ap.parse_args()
    if min(args.steps, args.share_steps, args.block_size) < 1 or (
        args.share_block_size is not None and args.share_block_size < 1
    ):
        ap.error("--steps, --share-steps, --block-size and --share-block-size must be positive")
    if not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    rows = []
    for running in (1, 64, 256):
        on = _measure(Scheduler, running, args.steps, args.block_size)
        off = _measure(_NoZeroScheduler, running, args.steps, args.block_size)
        rows.append({"running": running, "us_on": round(on, 1), "us_off": round(off, 1), "ratio": round(on / off, 3)})
        print(f"running={running:4d}  zero bookkeeping on {on:9.1f} us  off {off:9.1f} us  ratio {on / off:.3f}")
    print(json.dumps({"bench": "scheduler", "block_size": args.block_size, "steps": args.steps, "rows": rows}))
    shares = {}
    share_rows = []
    engine_block = args.share_block_size or _engine_block_size(args.model, args.dtype, args.device)
    runs = (
        ("sched_share_1", 1, engine_block),
        ("sched_share_64", 64, engine_block),
        ("sched_share_256", 256, engine_block),
        ("sched_share_256_block16", 256, 16),
    )
    for key, running, block_size in runs:
        # Two blocks' worth of steps: every request crosses into a new block at its natural rate.
        steps = max(args.share_steps, 2 * block_size)
        sched_us, step_us = _share(args.model, running, steps, block_size, args.dtype, args.device)
        shares[key] = round(sched_us / step_us, 4)
        share_rows.append(
            {
                "running": running,
                "block_size": block_size,
                "sched_us": round(sched_us, 1),
                "step_us": round(step_us, 1),
                "share": round(sched_us / step_us, 4),
            }
        )
        print(
            f"running={running:4d}  block {block_size:3d}  decode step {step_us:9.1f} us  scheduling {sched_us:9.1f} us  "
            f"share {sched_us / step_us:.3f}"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps({"schedule_us": rows, "share": share_rows}, indent=1))
    print(json.dumps(shares))


if __name__ == "__main__":
    main()
