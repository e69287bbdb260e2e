"""Micro-benchmark of `Scheduler.schedule()`: microseconds per call at 1, 64 and 256 running
requests, with the zero bookkeeping on (a hybrid model: new attention blocks recorded,
drained and filtered every step) and off (the same scheduler with the zero list dropped).
Ratios are against the "off" run measured in the same process.

    python -m bench.scheduler [--steps 300] [--block-size 4]
"""

from __future__ import annotations

import argparse
import json
import time

from actors.messages import ModelRunnerOutput, SamplingParams
from actors.request import Request
from actors.scheduler import Scheduler, SchedulerConfig
from actors.stop import StopChecker
from kv.kv_cache_manager import KVCacheManager
from models.batch import CacheGroup

GROUPS = (CacheGroup("attention", (1, 4)), CacheGroup("mamba", (0, 3)))


class _NoZeroScheduler(Scheduler):
    """The baseline: new block ids are drained but never become a zero list."""

    def _get_new_block_ids_to_zero(self, step: int) -> list[int] | None:
        self.kv.take_blocks_to_zero()
        return None


def _measure(cls: type[Scheduler], running: int, steps: int, block_size: int) -> float:
    blocks_per_req = -(-(16 + steps + 8) // block_size) + 1
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for running in (1, 64, 256):
        on = _measure(Scheduler, running, args.steps, args.block_size)
        off = _measure(_NoZeroScheduler, running, args.steps, args.block_size)
        rows.append({"running": running, "us_on": round(on, 1), "us_off": round(off, 1), "ratio": round(on / off, 3)})
        print(f"running={running:4d}  zero bookkeeping on {on:9.1f} us  off {off:9.1f} us  ratio {on / off:.3f}")
    print(json.dumps({"bench": "scheduler", "block_size": args.block_size, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
