"""A fake NIXL between simulated workers: READs that land outside the compute stream.

It keeps the real connector's contract (kv/nixl_worker.py): `start_load` is called when a
step is submitted, not on the compute stream; the READ lands at a seeded random moment,
possibly before that step's queued zeroing runs, possibly several steps later; landing
copies the prefill pages' content *as it is at that moment* (pages the prefill side has
freed and reused meanwhile give stale content, as real memory would); the decode side then
reports the load in `finished_recving`, or in `failed_loads` with the blocks left unread,
and the prefill side lists the request in its next `finished_sending`. Fault injection
matches the real one: a failed load reads only the first half (rounded down) of each
group's blocks, so a one-block Mamba group is not read at all.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv.transfer_params import KVTransferParams
from tests.sim.content import PageMemory


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
    peer: SimConnector
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


class Fabric:
    def __init__(self, rng: random.Random, fail_fraction: float, timing: TransferTiming) -> None:
        self.rng = rng
        self.fail_fraction = fail_fraction
        self.timing = timing
        self.agents: dict[str, SimConnector] = {}
        self.stats = FabricStats()
        self.landings = 0  # progress signal for the hang watchdog
        self._posted: dict[str, asyncio.Event] = {}

    def posted(self, req_id: str) -> asyncio.Event:
        """Set once a READ for `req_id` has been posted: clients may leave mid-load."""
        return self._posted.setdefault(req_id, asyncio.Event())

    def connect(self, engine_id: str, memory: PageMemory, steps_run: Callable[[], int]) -> SimConnector:
        conn = SimConnector(self, f"{engine_id}-agent", memory, steps_run)
        self.agents[conn.agent_name] = conn
        return conn


class SimConnector:
    def __init__(self, fabric: Fabric, agent_name: str, memory: PageMemory, steps_run: Callable[[], int]) -> None:
        self.fabric = fabric
        self.agent_name = agent_name
        self.memory = memory
        self._steps_run = steps_run  # how many of this worker's steps have run on its stream
        self._loads: dict[str, _Load] = {}
        self._pending = Finished()

    def start_load(self, req_id: str, params: KVTransferParams, local: Sequence[Sequence[int]], step_id: int) -> None:
        """Post the READ now. As the real connector: a load it cannot post (an unknown peer,
        block ids out of range) is reported failed with every local block; only a second load
        under one id raises."""
        if req_id in self._loads:
            raise ValueError(f"a load for {req_id!r} is already in flight")
        peer = self.fabric.agents.get(params.remote_agent_name)
        try:
            if peer is None:
                raise ValueError(f"unknown peer {params.remote_agent_name!r}")
            groups = self._pair(local, params.remote_block_ids, peer.memory.num_blocks)
        except ValueError:
            self._pending.failed[req_id] = [b for group in local for b in group]
            self.fabric.stats.failed_reqs.add(req_id)
            if peer is not None:
                peer._pending.sending.add(params.request_id)
            return
        fabric = self.fabric
        fabric.posted(req_id).set()
        fabric.stats.loads += 1
        # A run's first READ lands at once and never fails: it always beats its step's queued
        # zeroing, so the fix turned off is caught on every seed by construction, not by luck.
        first = fabric.stats.loads == 1
        fail = not first and fabric.fail_fraction > 0.0 and fabric.rng.random() < fabric.fail_fraction
        kept = [g[: len(g) // 2] for g in groups] if fail else groups
        load = _Load(
            peer,
            params.request_id,
            [p for g in kept for p in g],
            [mine for g, k in zip(groups, kept, strict=True) for mine, _ in g[len(k) :]],
            step_id,
        )
        if not load.pairs:  # nothing to read: the notification goes alone, the failure now
            peer._pending.sending.add(load.remote_req_id)
            self._report(req_id, load)
            return
        self._loads[req_id] = load
        delay = 0.0 if first else fabric.timing.draw(fabric.rng)
        asyncio.get_running_loop().call_later(delay, self._land, req_id)

    def send_notif(self, agent_name: str, req_id: str) -> None:
        peer = self.fabric.agents.get(agent_name)
        if peer is not None:  # an unknown peer: the real one logs it, and the lease frees the blocks
            peer._pending.sending.add(req_id)

    def get_finished(self) -> Finished:
        out, self._pending = self._pending, Finished()
        return out

    def _land(self, req_id: str) -> None:
        load = self._loads.pop(req_id)
        for mine, theirs in load.pairs:
            self.memory.copy_page(load.peer.memory, theirs, mine)
        if self._steps_run() <= load.step_id:
            self.fabric.stats.landed_before_zeroing += 1
        self.fabric.landings += 1
        load.peer._pending.sending.add(load.remote_req_id)
        self._report(req_id, load)

    def _report(self, req_id: str, load: _Load) -> None:
        if load.skipped:
            self.fabric.stats.failed += 1
            self.fabric.stats.failed_reqs.add(req_id)
            self._pending.failed[req_id] = load.skipped
        else:
            self._pending.recving.add(req_id)

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
                if not 0 <= a < self.memory.num_blocks or not 0 <= b < remote_num_blocks:
                    raise ValueError(f"group {g}: block pair ({a}, {b}) out of range")
                if a in seen:
                    raise ValueError(f"local block {a} is written twice by one load")
                seen.add(a)
            groups.append(pairs)
        return groups
