"""Routing at fleet scale without the fleet: 16-64 modelled engines on a virtual clock, routed by
the real routing code (api/routing/: the policies, conditional disaggregation, `route`, the
engines' summaries polled periodically and the router's own dispatch records between polls).

    python -m bench.fleet_sim [--sizes 16,32,64] [--duration-s 30] [--out bench/results/fleet_sim]

Each size is a PD fleet, half prefill and half decode engines (bench/fleet_model.py), serving the
same multi-turn shared-prefix chat trace (bench/fleet_trace.py) under each policy, and under
cache_aware with conditional disaggregation. Prints one markdown table (goodput, TTFT p50/p99,
prefix hit rate) and writes OUT.json.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from api.routing.fleet import EngineState
from api.routing.plan import route
from api.routing.policies import POLICIES, make_policy
from api.routing.prefix import PromptBlocks
from bench.fleet_model import EngineCosts, Job, ModelEngine
from bench.fleet_trace import Session, Trace, TraceShape


@dataclass(slots=True)
class Req:
    session: Session
    arrival: float
    num_outputs: int
    first: float | None = None
    last: float | None = None


@dataclass(frozen=True, slots=True)
class Variant:
    label: str
    policy: str
    min_prefill_tokens: int


class Simulation:
    def __init__(
        self, size: int, variant: Variant, costs: EngineCosts, shape: TraceShape, rate: float, seed: int, poll_s: float
    ) -> None:
        self.variant = variant
        self.policy = make_policy(variant.policy)  # type: ignore[arg-type]
        self.costs = costs
        self.poll_s = poll_s
        self.trace = Trace(shape, rate, seed)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.engines = [
            ModelEngine(f"{role}-{i}", role, costs, self._prefilled, self._token)
            for role, n in (("prefill", size // 2), ("decode", size - size // 2))
            for i in range(n)
        ]
        self.states = {e.name: EngineState(e.name, e.role) for e in self.engines}  # type: ignore[arg-type]
        self.by_name = {e.name: e for e in self.engines}
        self.requests: list[Req] = []
        self.local = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def kick(self, engine: ModelEngine) -> None:
        if engine.busy_until is None:
            engine.busy_until = self.now
            self.at(self.now, lambda: self._step(engine))

    def _step(self, engine: ModelEngine) -> None:
        end = engine.step(self.now)
        engine.busy_until = end
        if end is not None:
            self.at(end, lambda: self._step(engine))

    def _poll(self) -> None:
        for e in self.engines:
            state = self.states[e.name]
            state.record(e.summary(state.summary.cache_version if state.summary else None), self.now)
        self.at(self.now + self.poll_s, self._poll)

    def _arrive(self, until: float) -> None:
        self._turn(self.trace.new_session())
        gap = self.trace.next_arrival_gap()
        if self.now + gap < until:
            self.at(self.now + gap, lambda: self._arrive(until))

    def _turn(self, session: Session) -> None:
        ids, num_outputs = self.trace.next_turn(session)
        req = Req(session, self.now, num_outputs)
        self.requests.append(req)
        prompt = PromptBlocks(ids)
        candidates = list(self.states.values())
        plan = route(
            self.policy,
            [s for s in candidates if s.role == "decode"],
            [s for s in candidates if s.role == "prefill"],
            prompt,
            num_outputs,
            self.variant.min_prefill_tokens,
        )
        if plan.prefill is None:
            self.local += 1
            plan.decode.sent.append((self.now, plan.disagg.uncached_tokens))
            engine = self.by_name[plan.decode.name]
            engine.admit(Job(req, prompt, 0, num_outputs))
        else:
            plan.prefill.sent.append((self.now, len(prompt) - plan.prefill_hit))
            plan.decode.sent.append((self.now, 0))
            engine = self.by_name[plan.prefill.name]
            job = Job((req, plan.decode.name), prompt, 0, 0)
            engine.admit(job)
        self.kick(engine)

    def _prefilled(self, engine: ModelEngine, job: Job, t: float) -> None:
        req, decode_name = job.req
        decode = self.by_name[decode_name]
        c = self.costs

        def arrive() -> None:
            local_hit = 0
            for digest in job.prompt.digests(c.block_size):
                if digest not in decode.cache:
                    break
                local_hit += c.block_size
            moved = len(job.prompt) - local_hit
            loaded = Job(req, job.prompt, 0, req.num_outputs)

            def landed() -> None:
                decode.waiting.append(loaded)
                loaded.to_compute = 1  # the last prompt token: its step samples the first output
                self.kick(decode)

            self.at(self.now + c.transfer_base_s + c.transfer_token_s * moved, landed)

        self.at(t, arrive)

    def _token(self, engine: ModelEngine, job: Job, t: float) -> None:
        req: Req = job.req
        if req.first is None:
            req.first = t
        if job.outputs_left == 0:
            req.last = t
            self.trace.answer(req.session, req.num_outputs)
            if req.session.turns_left > 0:
                self.at(t + self.trace.think_time(req.session), lambda: self._turn(req.session))

    def run(self, duration_s: float, drain_s: float) -> None:
        self.at(0.0, lambda: self._arrive(duration_s))
        self.at(0.0, self._poll)
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            if t > duration_s + drain_s:
                break
            self.now = t
            fn()

    def report(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
        ttfts = sorted((r.first - r.arrival) if r.first is not None else math.inf for r in self.requests)
        good, end = 0, 0.0
        for r in self.requests:
            if r.first is None or r.last is None:
                continue
            tpot = (r.last - r.first) / (r.num_outputs - 1) if r.num_outputs > 1 else 0.0
            good += (r.first - r.arrival) <= slo_ttft_s and tpot <= slo_tpot_s
            end = max(end, r.last)
        hits = sum(e.hit_tokens for e in self.engines)
        prompts = sum(e.prompt_tokens for e in self.engines)

        def pct(p: float) -> float:
            return ttfts[min(int(p * len(ttfts)), len(ttfts) - 1)] * 1e3 if ttfts else math.nan

        return {
            "policy": self.variant.label,
            "requests": len(self.requests),
            "completed": sum(r.last is not None for r in self.requests),
            "goodput_req_s": good / end if end else 0.0,  # requests within the SLO per second of the run
            "ttft_p50_ms": pct(0.50),
            "ttft_p99_ms": pct(0.99),
            "prefix_hit_rate": hits / prompts if prompts else 0.0,
            "local_prefills": self.local,
        }


def _row(size: int, r: dict[str, Any]) -> str:
    def ms(v: float) -> str:
        return "inf" if math.isinf(v) else f"{v:,.0f}"

    return (
        f"| {size} | {r['policy']} | {r['requests']} | {r['completed']} | {r['goodput_req_s']:.1f} | "
        f"{ms(r['ttft_p50_ms'])} | {ms(r['ttft_p99_ms'])} | {100 * r['prefix_hit_rate']:.0f}% |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,32,64", help="engines per fleet, half prefill and half decode")
    parser.add_argument("--duration-s", type=float, default=15.0, help="virtual seconds of arrivals")
    parser.add_argument("--drain-s", type=float, default=60.0, help="virtual seconds after arrivals stop")
    parser.add_argument("--rate", type=float, default=3.0, help="new sessions per second per engine")
    parser.add_argument("--min-prefill-tokens", type=int, default=512, help="the conditional-disaggregation row")
    parser.add_argument("--poll-s", type=float, default=0.25, help="virtual seconds between summary polls")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fleet_sim"))
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r} is not a comma-separated list of integers")
    if any(s < 2 for s in sizes):
        parser.error("--sizes: each fleet needs at least 2 engines (one prefill, one decode)")
    variants = [Variant(p, p, 0) for p in POLICIES]
    variants.append(Variant(f"cache_aware, local < {args.min_prefill_tokens}", "cache_aware", args.min_prefill_tokens))
    costs, shape = EngineCosts(), TraceShape()
    print("| engines | policy | requests | completed | goodput req/s | TTFT p50 ms | TTFT p99 ms | prefix hits |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for size in sizes:
        for v in variants:
            sim = Simulation(size, v, costs, shape, args.rate * size, args.seed, args.poll_s)
            sim.run(args.duration_s, args.drain_s)
            r = sim.report(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
            results.append({"engines": size, **r})
            print(_row(size, r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "bench": "fleet_sim",
        "args": {k: str(v) for k, v in vars(args).items()},
        "costs": asdict(costs),
    }
    doc |= {"trace": asdict(shape), "runs": results}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
