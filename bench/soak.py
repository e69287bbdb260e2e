"""Soak test: mixed traffic with faults for N minutes against a `python -m serve` deployment.

    python -m bench.soak --minutes 10 [--concurrency 16] [--kill-every-s 45] [any `python -m serve` flag]

It starts the deployment (default 1 prefill + 2 decode engines, the shipped model, 10% of KV
loads failing, `--kv-verify` with 5% of landed loads corrupted, leases of 10 s), then runs `--concurrency` clients, each sending one request
after another (streams, whole responses, chat, n=2, clients leaving mid-stream, bad requests;
bench/soak_traffic.py) until the time is up, while engines are killed with `ray.kill` every
`--kill-every-s` (the supervisor replaces them) and a worker fault is injected every
`--worker-fault-every-s`. Then it waits until the engines are idle and reports: requests ok,
failed with a clear error, lost (must be 0); leaked KV blocks (must be 0); the resident memory
of the Ray worker processes at the start and the end. One JSON line on stdout, the full report
in `--out`; exit code 1 if a request was lost or a block leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, cast

import httpx
import ray

from actors.ports import free_port
from bench.rss import ray_worker_rss
from bench.soak_traffic import KINDS, WEIGHTS, Outcome, request
from engine.config import Config
from engine.messages import EngineStats
from serve import launch
from serve.config import ENV_PREFIX
from serve.config import parse_args as parse_serve_args
from serve.engines import NAMESPACE, engine_roles

REQUEST_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 120.0  # the engines' killed-peer leases run out within this
MAX_TOKENS = (8, 64)
DEFAULTS = {
    "prefill": 1,
    "decode": 2,
    "debug_kv_fail_percent": 10,
    "kv_verify": True,
    "debug_kv_corrupt_percent": 5,
    "kv_lease_s": 10,
    "worker_threads": 1,
}


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs")
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending at once")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="an upper bound on requests sent")
    parser.add_argument("--kill-every-s", type=float, default=45.0, help="seconds between engine kills (0: none)")
    parser.add_argument(
        "--worker-fault-every-s", type=float, default=30.0, help="seconds between injected worker faults (0: none)"
    )
    parser.add_argument("--traffic-seed", type=int, default=13, help="the traffic's and the faults' random seed")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"), help="the report file")


class Faults:
    """Engine kills and worker faults on a schedule, bounded by the run's deadline."""

    def __init__(self, cfg: Config, kill_every_s: float, fault_every_s: float, rng: random.Random) -> None:
        self.names = list(engine_roles(cfg))
        self.kill_every_s = kill_every_s
        self.fault_every_s = fault_every_s
        self.rng = rng
        self.events: list[dict[str, Any]] = []

    async def run(self, start: float, deadline: float) -> None:
        next_kill = start + self.kill_every_s if self.kill_every_s else float("inf")
        next_fault = start + self.fault_every_s if self.fault_every_s else float("inf")
        while True:
            now = time.monotonic()
            due = min(next_kill, next_fault)
            if due >= deadline:
                return
            await asyncio.sleep(max(0.0, due - now))
            name = self.rng.choice(self.names)
            kill = next_kill <= next_fault
            if kill:
                next_kill += self.kill_every_s
            else:
                next_fault += self.fault_every_s
            what = "kill" if kill else "worker_fault"
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                if kill:
                    ray.kill(handle)
                else:
                    await handle.inject_worker_faults.remote(1)
            except (ValueError, ray.exceptions.RayActorError):  # it is being replaced after a kill
                what += "_skipped"
            self.events.append({"t_s": round(due - start, 1), what: name})


async def _traffic(url: str, prompts: list[str], args: argparse.Namespace, deadline: float) -> list[Outcome]:
    rng = random.Random(args.traffic_seed)
    outcomes: list[Outcome] = []
    sent = 0

    async def client(seed: int) -> None:
        nonlocal sent
        crng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as c:
            while time.monotonic() < deadline and sent < args.max_requests:
                sent += 1
                kind = crng.choices(KINDS, WEIGHTS)[0]
                out = await request(c, kind, crng.choice(prompts), crng.randint(*MAX_TOKENS), crng)
                outcomes.append(out)
                if out.detail.startswith("503"):
                    await asyncio.sleep(1.0)  # as Retry-After says

    await asyncio.gather(*(client(rng.randrange(2**32)) for _ in range(args.concurrency)))
    return outcomes


def _idle_stats(name: str) -> EngineStats:
    handle: Any = ray.get_actor(name, namespace=NAMESPACE)
    return cast(EngineStats, ray.get(handle.wait_idle.remote(), timeout=30))


def _wait_idle(names: list[str]) -> dict[str, dict[str, int]]:
    """Every engine's blocks once it is idle (replacements included)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        try:
            stats = {n: _idle_stats(n) for n in names}
        except (ValueError, ray.exceptions.RayError):  # an engine is still being replaced
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            continue
        blocks = {n: {"free": s.num_blocks_free, "total": s.num_blocks_total} for n, s in stats.items()}
        if all(b["free"] == b["total"] for b in blocks.values()) or time.monotonic() > deadline:
            return blocks
        time.sleep(1.0)  # prefill KV held for a killed decode engine waits for its lease


async def _soak(url: str, cfg: Config, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    deadline = start + args.minutes * 60
    faults = Faults(cfg, args.kill_every_s, args.worker_fault_every_s, random.Random(args.traffic_seed + 1))
    fault_task = asyncio.ensure_future(faults.run(start, deadline))
    outcomes = await _traffic(url, prompts, args, deadline)
    await fault_task
    by_result = collections.Counter(o.result for o in outcomes)
    details = collections.Counter(f"{o.result}: {o.kind}: {o.detail}" for o in outcomes if o.result != "ok")
    return {
        "duration_s": round(time.monotonic() - start, 1),
        "requests": len(outcomes),
        "ok": by_result["ok"],
        "failed_clear": by_result["failed"],
        "lost": by_result["lost"],
        "by_kind": dict(collections.Counter(o.kind for o in outcomes)),
        "not_ok": dict(details.most_common()),
        "faults": faults.events,
    }


def _rss_mib() -> dict[str, Any]:
    """Resident memory of the deployment's Ray processes, in total and by actor class (a
    process's title names the method it runs: `ray::EngineActor.get_outputs`)."""
    rss = ray_worker_rss()
    by_class: collections.Counter[str] = collections.Counter()
    for title, size in rss.items():
        by_class[title.split()[0].removeprefix("ray::").split(".")[0]] += size
    return {
        "total_mib": round(sum(rss.values()) / 2**20, 1),
        "processes": len(rss),
        "by_class_mib": {k: round(v / 2**20, 1) for k, v in sorted(by_class.items())},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_serve_args(argv, extra=_flags)
    given = set(vars(args)) | {k for k in DEFAULTS if ENV_PREFIX + k.upper() in os.environ}
    cfg = dataclasses.replace(args.config, port=free_port(), **{k: v for k, v in DEFAULTS.items() if k not in given})
    lines = (Path(cfg.model) / "eval.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    dep = launch.start(cfg, include_dashboard=False, log_to_driver=False)
    try:
        httpx.post(dep.url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 4}, timeout=60)
        rss_start = _rss_mib()
        result = asyncio.run(_soak(dep.url, cfg, prompts, args))
        blocks = _wait_idle(list(engine_roles(cfg)))
        rss_end = _rss_mib()
        health = httpx.get(dep.url + "/health", timeout=10).status_code
    finally:
        launch.stop(dep)
    leaked = sum(b["total"] - b["free"] for b in blocks.values())
    report = {
        "bench": "soak",
        "layout": f"{cfg.prefill}x{cfg.decode}",
        "kv_fail_percent": cfg.debug_kv_fail_percent,
        "concurrency": args.concurrency,
        **result,
        "leaked_blocks": leaked,
        "blocks": blocks,
        "health_after": health,
        "rss_start": rss_start,
        "rss_end": rss_end,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("duration_s", "requests", "ok", "failed_clear", "lost", "leaked_blocks", "health_after")
    line = {k: report[k] for k in keys} | {"rss_start_mib": rss_start["total_mib"], "rss_end_mib": rss_end["total_mib"]}
    print(json.dumps(line), flush=True)
    return 1 if report["lost"] or leaked or health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
