"""A fake NIXL between simulated workers: READs that land outside the compute stream.

It keeps the real connector's contract (kv/nixl/worker.py): `start_load` is called when a
step is submitted, not on the compute stream; the READ lands at a seeded random moment,
possibly before that step's queued zeroing runs, possibly several steps later; landing
copies the prefill pages' content *as it is at that moment* (pages the prefill side has
freed and reused meanwhile give stale content, as real memory would); the decode side then
reports the load in `finished_recving`, or in `failed_loads` with the blocks left unread,
and the prefill side lists the request in its next `finished_sending`. Fault injection
matches the real one: a failed load reads only the first half (rounded down) of each
group's blocks, so a one-block Mamba group is not read at all.

Tensor parallelism (tests/sim/ranks.py): every rank has its own connector and memory per
head it holds. A decode rank reads each of its heads from the prefill rank holding it and
notifies each prefill rank it reads from; a prefill rank read by n decode ranks reports the
request read once all n notified (the count travels with the notification, as in
kv/nixl/worker.py). Each rank draws its own failure and landing time, so a load can fail
on one rank only and land at different moments on each.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv.nixl.transfer_params import KVTransferParams
from tests.sim.content import PageMemory
from tests.sim.ranks import owner, readers


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """When a READ lands after it is posted, in virtual seconds."""

    p_immediate: float = 0.3  # before anything else runs: ahead of the step's queued zeroing
    p_late: float = 0.2  # several steps later
    short_s: tuple[float, float] = (0.0001, 0.002)
    late_s: tuple[float, float] = (0.004, 0.03)

    def draw(self, rng: random.Random) -> float:
        r = rng.random()
        if r < self.p_immediate:
            return 0.0
        lo, hi = self.late_s if r < self.p_immediate + self.p_late else self.short_s
        return rng.uniform(lo, hi)


@dataclass(slots=True)
class Finished:
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class _Load:
    peers: list[SimConnector]  # every rank of the engine read from
    remote_req_id: str
    pairs: list[tuple[int, int]]  # (local, remote) pages the READ copies
    skipped: list[int]
    step_id: int


@dataclass(slots=True)
class FabricStats:
    loads: int = 0
    failed: int = 0
    landed_before_zeroing: int = 0  # landed while the step that posted them was still queued
    failed_reqs: set[str] = field(default_factory=set)
    failed_ranks: dict[str, set[int]] = field(default_factory=dict)  # request -> ranks whose load failed


class Fabric:
    def __init__(self, rng: random.Random, fail_fraction: float, timing: TransferTiming) -> None:
        self.rng = rng
        self.fail_fraction = fail_fraction
        self.timing = timing
        self.agents: dict[str, SimConnector] = {}
        self.engines: dict[str, list[SimConnector]] = {}  # an engine's (rank 0's) agent -> its ranks
        self._first_req: str | None = None
        self.stats = FabricStats()
        self.landings = 0  # progress signal for the hang watchdog
        self._posted: dict[str, asyncio.Event] = {}

    def posted(self, req_id: str) -> asyncio.Event:
        """Set once a READ for `req_id` has been posted: clients may leave mid-load."""
        return self._posted.setdefault(req_id, asyncio.Event())

    def connect(
        self, engine_id: str, rank: int, tp: int, memories: dict[int, PageMemory], steps_run: Callable[[], int]
    ) -> SimConnector:
        """Rank `rank`'s connector; ranks connect in rank order. Rank 0's agent is the
        engine's: the one KVTransferParams name."""
        engine_agent = f"{engine_id}-agent"
        name = engine_agent if rank == 0 else f"{engine_agent}-tp{rank}"
        conn = SimConnector(self, name, rank, tp, memories, steps_run)
        self.agents[name] = conn
        ranks = self.engines.setdefault(engine_agent, [])
        if len(ranks) != rank:
            raise ValueError(f"{name} connects as rank {rank} after {len(ranks)} ranks")
        ranks.append(conn)
        return conn

    def is_first(self, req_id: str) -> bool:
        """Whether `req_id` is the run's first request loaded (on every rank)."""
        if self._first_req is None:
            self._first_req = req_id
        return req_id == self._first_req


class SimConnector:
    def __init__(
        self,
        fabric: Fabric,
        agent_name: str,
        rank: int,
        tp: int,
        memories: dict[int, PageMemory],
        steps_run: Callable[[], int],
    ) -> None:
        self.fabric = fabric
        self.agent_name = agent_name
        self.rank, self.tp = rank, tp
        self.memories = memories  # head -> this rank's pages of it
        self.num_blocks = next(iter(memories.values())).num_blocks
        self._steps_run = steps_run  # how many of this worker's steps have run on its stream
        self._loads: dict[str, _Load] = {}
        self._pending = Finished()
        self._notif_counts: dict[str, int] = {}  # prefill side: notifications counted so far

    def start_load(self, req_id: str, params: KVTransferParams, local: Sequence[Sequence[int]], step_id: int) -> None:
        """Post the READ now. As the real connector: a load it cannot post (an unknown peer,
        block ids out of range) is reported failed with every local block; only a second load
        under one id raises."""
        if req_id in self._loads:
            raise ValueError(f"a load for {req_id!r} is already in flight")
        peers = self.fabric.engines.get(params.remote_agent_name)
        try:
            if peers is None:
                raise ValueError(f"unknown peer {params.remote_agent_name!r}")
            groups = self._pair(local, params.remote_block_ids, peers[0].num_blocks)
        except ValueError:
            self._pending.failed[req_id] = [b for group in local for b in group]
            self._count_failure(req_id)
            if peers is not None:
                self._notify(peers, params.request_id)
            return
        fabric = self.fabric
        fabric.posted(req_id).set()
        fabric.stats.loads += 1
        # A run's first request's READs land at once and never fail: they always beat their
        # step's queued zeroing, so the fix turned off is caught on every seed by construction.
        first = fabric.is_first(req_id)
        fail = not first and fabric.fail_fraction > 0.0 and fabric.rng.random() < fabric.fail_fraction
        kept = [g[: len(g) // 2] for g in groups] if fail else groups
        load = _Load(
            peers,
            params.request_id,
            [p for g in kept for p in g],
            [mine for g, k in zip(groups, kept, strict=True) for mine, _ in g[len(k) :]],
            step_id,
        )
        if not load.pairs:  # nothing to read: the notification goes alone, the failure now
            self._notify(peers, load.remote_req_id)
            self._report(req_id, load)
            return
        self._loads[req_id] = load
        delay = 0.0 if first else fabric.timing.draw(fabric.rng)
        asyncio.get_running_loop().call_later(delay, self._land, req_id)

    def send_notif(self, agent_name: str, req_id: str) -> None:
        peers = self.fabric.engines.get(agent_name)
        if peers is not None:  # an unknown peer: the real one logs it, and the lease frees the blocks
            self._notify(peers, req_id)

    def get_finished(self) -> Finished:
        out, self._pending = self._pending, Finished()
        return out

    def held(self) -> dict[str, int]:
        """As `NixlWorkerConnector.held`: each zero once the engine is idle."""
        return {
            "loads": len(self._loads),
            "unreported_loads": len(self._pending.recving) + len(self._pending.failed),
            "partial_notifs": len(self._notif_counts),
        }

    def _land(self, req_id: str) -> None:
        load = self._loads.pop(req_id)
        for head, memory in self.memories.items():
            source = load.peers[owner(head, len(load.peers))].memories[head]
            for mine, theirs in load.pairs:
                memory.copy_page(source, theirs, mine)
        if self._steps_run() <= load.step_id:
            self.fabric.stats.landed_before_zeroing += 1
        self.fabric.landings += 1
        self._notify(load.peers, load.remote_req_id)
        self._report(req_id, load)

    def _notify(self, peers: list[SimConnector], req_id: str) -> None:
        """Notify every remote rank this rank reads from, each told how many ranks will."""
        remote_tp = len(peers)
        for p in sorted({owner(h, remote_tp) for h in self.memories}):
            peers[p]._notified(req_id, readers(p, remote_tp, self.tp))

    def _notified(self, req_id: str, count: int) -> None:
        seen = self._notif_counts.pop(req_id, 0) + 1
        if seen >= count:
            self._pending.sending.add(req_id)
        else:
            self._notif_counts[req_id] = seen

    def _report(self, req_id: str, load: _Load) -> None:
        if load.skipped:
            self._count_failure(req_id)
            self._pending.failed[req_id] = load.skipped
        else:
            self._pending.recving.add(req_id)

    def _count_failure(self, req_id: str) -> None:
        stats = self.fabric.stats
        stats.failed += 1
        stats.failed_reqs.add(req_id)
        stats.failed_ranks.setdefault(req_id, set()).add(self.rank)

    def _pair(
        self, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], remote_num_blocks: int
    ) -> list[list[tuple[int, int]]]:
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local block lists for {len(remote)} remote cache groups")
        groups: list[list[tuple[int, int]]] = []
        seen: set[int] = set()
        for g, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
            if len(theirs) > len(mine):
                raise ValueError(f"group {g}: {len(theirs)} remote blocks do not fit in {len(mine)} local ones")
            pairs = list(zip(mine, theirs, strict=False))  # the remote list may be shorter
            for a, b in pairs:
                if not 0 <= a < self.num_blocks or not 0 <= b < remote_num_blocks:
                    raise ValueError(f"group {g}: block pair ({a}, {b}) out of range")
                if a in seen:
                    raise ValueError(f"local block {a} is written twice by one load")
                seen.add(a)
            groups.append(pairs)
        return groups
