"""The real engine, scheduler and KV manager, each driving its simulated workers (one per
tensor-parallel rank, merged by the engine's real `RankMerger`).

Built as engine/build.py builds them, with the simulated workers' `StepExecutor`s and the
connector's lease clock on the loop's virtual time.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Literal

from actors.client import EngineCalls, EngineClient
from engine.core import EngineCore
from engine.pd import DisaggConfig
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.kv_cache_manager import KVCacheManager
from tests.sim.content import Provenance
from tests.sim.fabric import Fabric
from tests.sim.ranks import Collective
from tests.sim.sim_worker import SimWorker
from tests.sim.workload import BLOCK_SIZE, EOS, MAX_MODEL_LEN, Shape

Role = Literal["colocated", "prefill", "decode"]


@dataclass(slots=True)
class SimEngine:
    name: str
    core: EngineCore
    workers: list[SimWorker]  # rank order
    client: EngineClient

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def progress_key(self) -> tuple[int, ...]:
        """Changes whenever the engine does something other than poll."""
        s = self.scheduler
        return (
            s.kv.num_free_blocks,
            len(s.waiting),
            len(s.running),
            *((len(s.pd.loading), len(s.pd.held)) if s.pd else ()),
            self.workers[0].steps_run if s.running else 0,
        )

    def is_idle(self) -> bool:
        return not self.scheduler.has_work() and not self.core._in_flight

    def leaks(self) -> bool:
        return self.scheduler.kv.num_free_blocks != self.scheduler.kv.num_blocks

    def dump(self) -> str:
        """The scheduler's queues, for a HANG or LEAK report."""
        s = self.scheduler

        def req(r: Request) -> str:
            blocks = sum(len(b) for b in s.kv.get_block_ids(r.req_id))
            return f"{r.req_id}({r.status.value}, computed {r.num_computed_tokens}/{r.num_tokens}, {blocks} blocks)"

        owners = {rid: sum(len(b) for b in s.kv.get_block_ids(rid)) for rid in s.kv.managers[0].req_to_blocks}
        return (
            f"{self.name}: free {s.kv.num_free_blocks}/{s.kv.num_blocks}, "
            f"waiting [{', '.join(map(req, s.waiting))}], running [{', '.join(map(req, s.running))}], "
            f"loading {sorted(s.pd.loading) if s.pd else []}, held {len(s.pd.held) if s.pd else 0}, "
            f"block owners {owners}, "
            f"failure {self.core._failure!r}"
        )

    async def close(self) -> None:
        await self.client.close()
        await self.core.close()
        for worker in self.workers:
            await worker.close()


def build_engine(
    shape: Shape,
    role: Role,
    name: str,
    num_blocks: int,
    prov: Provenance,
    seed: int,
    fabric: Fabric | None,
    debug_zero_loaded_blocks: bool = False,
) -> SimEngine:
    tp = shape.prefill_tp if role == "prefill" else shape.decode_tp
    collective = Collective(tp)
    workers = [
        SimWorker(
            name,
            shape.groups,
            num_blocks,
            BLOCK_SIZE,
            prov,
            random.Random(f"{shape.name}/{seed}/{name}/stream" + (f"/{rank}" if rank else "")),
            shape.lag_s,
            fabric if role != "colocated" else None,
            rank,
            collective,
        )
        for rank in range(tp)
    ]
    kv = KVCacheManager(shape.groups, num_blocks, BLOCK_SIZE, shape.prefix_caching, shape.checkpoint_interval)
    budget = shape.max_batched_tokens
    if role == "prefill" and shape.prefill_max_batched_tokens is not None:
        budget = shape.prefill_max_batched_tokens
    cfg = SchedulerConfig(budget, shape.max_num_seqs, MAX_MODEL_LEN)
    disagg = (
        None
        if role == "colocated"
        else DisaggConfig(
            role, name, shape.lease_s, debug_zero_loaded_blocks, shape.policy, workers[0].agent_name, tp_size=tp
        )
    )
    scheduler = Scheduler(cfg, kv, StopChecker(None, MAX_MODEL_LEN), disagg)
    if scheduler.pd is not None:
        scheduler.pd.connector.clock = asyncio.get_running_loop().time  # leases in virtual seconds
    core = EngineCore(
        scheduler,
        [w.executor() for w in workers],
        shape.async_scheduling,
        eos_token_id=EOS,
        prefill_hold_s=shape.prefill_hold_s,
        clock=asyncio.get_running_loop().time,
    )
    return SimEngine(name, core, workers, EngineClient(EngineCalls.local(core)))
