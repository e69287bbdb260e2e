"""One simulated run: a colocated reference engine, then prefill + decode engines, on one
virtual-time loop, and every check the randomized suite makes.

A run's report lists problems, each naming the shape, seed, request, and where it applies
the step, block and expected vs found content:
- BAD READ: a forward read an entry that is not what the token history implies;
- WRONG OUTPUT: a completed request whose greedy tokens differ from the colocated run's
  (or the colocated run's from the token function itself), or an error it had no cause for;
- HANG: no progress for `_STALL_S` virtual seconds (every wait is bounded), with the
  engines' queues;
- LEAK: an engine idle (between bursts of requests, or at the end) whose free blocks are not
  all its blocks, or whose KV manager fails `check_integrity()`; at the end, a rank still
  holding a request, a load, an unreported load or a partly counted notification, or
  an engine whose rank merge still holds a partial tally;
- WAIT_IDLE RACE: `EngineCore.wait_idle` returned while a step was still in flight (its
  blocks came back later);
- ENGINE FAILURE: an engine loop that died.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kv.block_pool import IntegrityError
from kv.nixl.scheduler import LEASE_MARGIN_S
from tests.engine.fake_worker import reference
from tests.sim.clients import Outcome, Tally, colocated_request, pd_request
from tests.sim.content import Provenance
from tests.sim.engines import SimEngine, build_engine
from tests.sim.fabric import Fabric
from tests.sim.vclock import LoopStalled, run_virtual
from tests.sim.workload import EOS, RequestSpec, Shape, make_requests

_RUN_LIMIT_S = 120.0  # virtual seconds a whole phase may take
_IDLE_LIMIT_S = 5.0
_WATCH_EVERY_S = 0.05
_STALL_S = 1.0  # a step takes at most a few virtual ms: a second without progress is a hang


@dataclass(slots=True)
class RunReport:
    shape: str
    seed: int
    problems: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, text: str) -> None:
        self.problems.append(f"[{self.shape} seed {self.seed}] {kind}: {text}")

    def kinds(self) -> set[str]:
        """The first word of each problem's kind: BAD, WRONG, HANG, LEAK, WAIT_IDLE, ENGINE."""
        return {p.split("] ", 1)[1].split(":", 1)[0].split(" ")[0] for p in self.problems}

    def summary(self, limit: int = 12) -> str:
        more = len(self.problems) - limit
        return "\n".join(self.problems[:limit] + ([f"... and {more} more"] if more > 0 else []))


def run_shape(shape: Shape, seed: int, debug_zero_loaded_blocks: bool = False) -> RunReport:
    report = RunReport(shape.name, seed)
    specs = make_requests(shape, seed)
    try:
        run_virtual(_run(shape, seed, specs, report, debug_zero_loaded_blocks))
    except LoopStalled as e:
        report.add("HANG", str(e))
    return report


async def _run(shape: Shape, seed: int, specs: list[RequestSpec], report: RunReport, debug_zero: bool) -> None:
    prov = Provenance()
    reference_tokens = await _colocated_phase(shape, seed, specs, report, prov)
    if shape.pd:
        await _pd_phase(shape, seed, specs, report, prov, reference_tokens, debug_zero)


async def _colocated_phase(
    shape: Shape, seed: int, specs: list[RequestSpec], report: RunReport, prov: Provenance
) -> dict[str, list[int]]:
    """The reference: every request to the end on one colocated engine; its outputs must be
    the token function's own."""
    colo = build_engine(shape, "colocated", "colocated", shape.decode_blocks, prov, seed, None)
    outs = {s.req_id: Outcome(s.req_id, s.arrival_s) for s in specs}
    tally = Tally()
    await _phase(
        report,
        [colo],
        tally,
        [(colocated_request(s, colo.client, outs[s.req_id], tally), outs[s.req_id]) for s in specs],
    )
    for s in specs:
        want = reference(s.prompt, s.max_tokens, EOS)
        got = outs[s.req_id]
        if got.finish != _finish_reason(want) or got.tokens != want:
            report.add(
                "WRONG OUTPUT",
                f"colocated request {s.req_id}: finish {got.finish} {got.error or ''} "
                f"tokens {got.tokens}, the token function gives {want}",
            )
    await _finish(report, [colo])
    report.stats["colocated_preemptions"] = colo.scheduler.num_preemptions
    report.stats["colocated_prefix_hits"] = colo.scheduler.prefix_cache_hits
    return {r: o.tokens for r, o in outs.items()}


async def _pd_phase(
    shape: Shape,
    seed: int,
    specs: list[RequestSpec],
    report: RunReport,
    prov: Provenance,
    reference_tokens: dict[str, list[int]],
    debug_zero: bool,
) -> None:
    fabric = Fabric(random.Random(f"{shape.name}/{seed}/fabric"), shape.fail_fraction, shape.timing)
    prefill = build_engine(shape, "prefill", "prefill", shape.prefill_blocks, prov, seed, fabric)
    decode = build_engine(shape, "decode", "decode", shape.decode_blocks, prov, seed, fabric, debug_zero)
    outs = {s.req_id: Outcome(s.req_id, s.arrival_s) for s in specs}
    tally = Tally()
    jobs = [
        (pd_request(s, prefill.client, decode.client, fabric.posted(s.req_id), outs[s.req_id], tally), outs[s.req_id])
        for s in specs
    ]
    await _phase(report, [prefill, decode], tally, jobs, fabric)
    for s in specs:
        _check_pd_outcome(report, shape, s, outs[s.req_id], reference_tokens[s.req_id], fabric)
    await _finish(report, [prefill, decode])
    report.stats.update(
        loads=fabric.stats.loads,
        failed_loads=fabric.stats.failed,
        landed_before_zeroing=fabric.stats.landed_before_zeroing,
        decode_preemptions=decode.scheduler.num_preemptions,
        blocks_skipped=decode.scheduler.blocks_skipped,
        decode_failed_loads=decode.scheduler.pd.num_failed_loads,
        decode_prefix_hits=decode.scheduler.prefix_cache_hits,
        prefill_prefix_hits=prefill.scheduler.prefix_cache_hits,
        decode_pages_copied=sum(w.pages_copied for w in decode.workers),
        # loads that failed on some ranks and landed on the others (the merge must fail them)
        one_rank_failed=sum(len(r) < shape.decode_tp for r in fabric.stats.failed_ranks.values()),
        failed_load_reqs=len(fabric.stats.failed_ranks),
        expired_leases=decode.scheduler.pd.num_expired_leases,
        aborted=sum(s.abort is not None for s in specs),
        completed=sum(o.finish in ("length", "stop") for o in outs.values()),
    )


def _check_pd_outcome(
    report: RunReport, shape: Shape, spec: RequestSpec, got: Outcome, want: list[int], fabric: Fabric
) -> None:
    where = f"request {spec.req_id} (prompt {len(spec.prompt)} tokens, abort {spec.abort})"
    if got.finish in ("timeout", "cancelled", "pending"):
        report.add("HANG", f"{where} never ended ({got.finish}); it had {got.tokens}")
        return
    if got.tokens != want[: len(got.tokens)]:
        report.add("WRONG OUTPUT", f"{where}: got {got.tokens}, colocated gave {want}")
        return
    if got.finish == "error":
        # A lease can end (by the decode side's margin) before its request is read.
        expired = (
            got.handed_over_at is not None
            and (got.ended_at or 0.0) >= got.handed_over_at + shape.lease_s - LEASE_MARGIN_S
        )
        if shape.policy != "fail" or not (spec.req_id in fabric.stats.failed_reqs or expired):
            report.add("WRONG OUTPUT", f"{where} failed with no failed load: {got.error}")
        return
    if spec.abort is None and (got.finish != _finish_reason(want) or len(got.tokens) != len(want)):
        report.add("WRONG OUTPUT", f"{where}: finish {got.finish} with {got.tokens}, colocated gave {want}")


def _finish_reason(tokens: list[int]) -> str:
    return "stop" if tokens and tokens[-1] == EOS else "length"


async def _guard(coro: Coroutine[Any, Any, None], out: Outcome, tally: Tally) -> None:
    try:
        await asyncio.wait_for(coro, _RUN_LIMIT_S)
    except TimeoutError:
        out.finish = "timeout"
    except asyncio.CancelledError:
        out.finish = "cancelled"
    except Exception as e:  # a client-side error is an outcome to check, not a crash of the suite
        out.finish, out.error = "error", f"client raised {e!r}"
    out.ended_at = asyncio.get_running_loop().time()
    tally.ended += 1


async def _phase(
    report: RunReport,
    engines: list[SimEngine],
    tally: Tally,
    jobs: list[tuple[Coroutine[Any, Any, None], Outcome]],
    fabric: Fabric | None = None,
) -> None:
    """Run the clients to the end; a stall (no engine, client or transfer moved for
    `_STALL_S`) is a HANG: the clients are cancelled and the engines' queues reported."""
    tasks = [asyncio.create_task(_guard(coro, out, tally)) for coro, out in jobs]
    loop = asyncio.get_running_loop()
    last_key: tuple[Any, ...] = ()
    last_change = loop.time()
    idle_before: set[str] = set()
    leaked: set[str] = set()
    while not all(t.done() for t in tasks):
        await asyncio.wait(tasks, timeout=_WATCH_EVERY_S)
        now = loop.time()
        quiet = all(t.done() or out.arrival_s > now for (_, out), t in zip(jobs, tasks, strict=True))
        idle = {e.name for e in engines if quiet and e.is_idle()}
        for e in engines:
            # Idle at two checks in a row: no step can still be in flight, so every block must
            # be back in the pool. Checked during the run because blocks fenced on a step that
            # is never scheduled come back as soon as new work makes the engine step again.
            if e.name in idle & idle_before and e.name not in leaked and e.leaks():
                leaked.add(e.name)
                kv = e.scheduler.kv
                report.add(
                    "LEAK",
                    f"{e.name} idle between requests at {now:.3f} s (virtual) with "
                    f"{kv.num_free_blocks}/{kv.num_blocks} blocks free: {e.dump()}",
                )
        idle_before = idle
        key = (tally.tokens, tally.ended, fabric.landings if fabric else 0, *(e.progress_key() for e in engines))
        if key != last_key:
            last_key, last_change = key, loop.time()
        elif loop.time() - last_change > _STALL_S:
            stuck = [out.req_id for (_, out), t in zip(jobs, tasks, strict=True) if not t.done()]
            report.add(
                "HANG",
                f"no progress for {_STALL_S:.1f} s (virtual); requests open {stuck}; "
                + " | ".join(e.dump() for e in engines),
            )
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return


async def _finish(report: RunReport, engines: list[SimEngine]) -> None:
    """Idle checks, bad reads and engine failures; then close the engines."""
    for e in engines:
        bad_reads = [b for w in e.workers for b in w.bad_reads]
        for bad in bad_reads:
            report.add("BAD READ", str(bad))
        report.stats["bad_reads"] = report.stats.get("bad_reads", 0) + len(bad_reads)
        report.stats["zeroed_reads"] = report.stats.get("zeroed_reads", 0) + sum(b.found_zero for b in bad_reads)
        if e.core._failure is not None:
            report.add("ENGINE FAILURE", f"{e.name}: {e.core._failure!r}")
            continue
        try:
            await asyncio.wait_for(e.core.wait_idle(), _IDLE_LIMIT_S)
        except TimeoutError:
            report.add("HANG", f"{e.name} never became idle: {e.dump()}")
            continue
        kv = e.scheduler.kv
        free_at_return = kv.num_free_blocks
        await asyncio.sleep(0.05)  # long enough for any step still in flight to report
        if free_at_return != kv.num_blocks and kv.num_free_blocks == kv.num_blocks:
            report.add(
                "WAIT_IDLE RACE",
                f"{e.name}: wait_idle returned with {free_at_return}/{kv.num_blocks} "
                "blocks free, all free 50 ms later (a step was still in flight)",
            )
        if kv.num_free_blocks != kv.num_blocks:
            report.add("LEAK", f"{e.name} idle with {kv.num_free_blocks}/{kv.num_blocks} blocks free: {e.dump()}")
        try:
            kv.check_integrity()
        except IntegrityError as err:
            report.add("LEAK", f"{e.name} check_integrity: {err}")
        for w in e.workers:
            if any((held := w.held()).values()):
                report.add("LEAK", f"{w.name} idle still holds {held}")
        if e.core.merger.num_partial:
            report.add("LEAK", f"{e.name} idle with {e.core.merger.num_partial} partial rank tallies")
    for e in engines:
        await e.close()
