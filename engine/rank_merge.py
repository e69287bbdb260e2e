"""One step result from the results of an engine's tensor-parallel ranks.

Every rank runs every step (the same `SchedulerOutput`, zero list included) and ends it with
the same logits (models/tensor_parallel.py), so every rank samples the same tokens from the
same seeded generators: each rank needs them, its token lists are what the next step
computes. Rank 0's tokens are the engine's; a rank that disagrees is a fault, not noise.

KV transfers end per rank and at different steps: each rank moves its own shard. A load
is done only when every rank's part landed, and failed when any rank's part failed (the
union of the blocks left invalid), but only once every rank has ended its part: a part
still in flight writes the blocks the scheduler would free or recompute into. A prefill
request's blocks are read once every rank has been notified: each rank's notification is
passed on, and the PD component's record of the held request counts them (engine/pd.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.messages import ModelRunnerOutput


class RankDisagreementError(RuntimeError):
    """Tensor-parallel ranks sampled different tokens: their logits were not the same."""


@dataclass(slots=True)
class _LoadTally:
    ranks: set[int] = field(default_factory=set)
    bad: set[int] = field(default_factory=set)
    failed: bool = False


class RankMerger:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._loads: dict[str, _LoadTally] = {}

    def merge(self, results: Sequence[ModelRunnerOutput]) -> ModelRunnerOutput:
        if len(results) != self.num_ranks:
            raise ValueError(f"{len(results)} results for {self.num_ranks} ranks")
        first = results[0]
        if self.num_ranks == 1:
            return first
        failed_reqs: dict[str, str] = {}
        for r in results:
            failed_reqs.update(r.failed_reqs)
        sampled = first.sampled
        if failed_reqs:
            # A request one rank failed fails on all (the engine ends it and tells every rank),
            # whatever the others sampled for it: a grammar may miss its compile deadline on one
            # rank only (worker/grammar.py).
            sampled = {req_id: t for req_id, t in sampled.items() if req_id not in failed_reqs}
        for rank, r in enumerate(results[1:], start=1):
            theirs = r.sampled if not failed_reqs else {q: t for q, t in r.sampled.items() if q not in failed_reqs}
            if theirs != sampled:
                raise RankDisagreementError(f"step {first.step_id}: rank {rank} sampled {theirs}, rank 0 {sampled}")
        recving, failed_loads = self._ended_loads(results)
        return dataclasses.replace(
            first,
            sampled=sampled,
            finished_sending=[req_id for r in results for req_id in r.finished_sending],
            finished_recving=recving,
            failed_loads=failed_loads,
            failed_reqs=failed_reqs,
            # --kv-verify: each prefill rank checksums its own shard; the table lists them by rank.
            kv_checksums={
                req_id: [t for r in results for t in r.kv_checksums.get(req_id, [])] for req_id in first.kv_checksums
            },
        )

    def _ended_loads(self, results: Sequence[ModelRunnerOutput]) -> tuple[list[str], dict[str, list[int]]]:
        ended: list[str] = []
        for rank, r in enumerate(results):
            for req_id in r.finished_recving:
                self._loads.setdefault(req_id, _LoadTally()).ranks.add(rank)
                ended.append(req_id)
            for req_id, bad in r.failed_loads.items():
                tally = self._loads.setdefault(req_id, _LoadTally())
                tally.ranks.add(rank)
                tally.failed = True
                tally.bad.update(bad)
                ended.append(req_id)
        done: list[str] = []
        failed: dict[str, list[int]] = {}
        for req_id in dict.fromkeys(ended):
            tally = self._loads[req_id]
            if len(tally.ranks) < self.num_ranks:
                continue
            del self._loads[req_id]
            if tally.failed:
                failed[req_id] = sorted(tally.bad)
            else:
                done.append(req_id)
        return done, failed

    @property
    def num_partial(self) -> int:
        """Loads that some but not all ranks have reported (zero once idle)."""
        return len(self._loads)
