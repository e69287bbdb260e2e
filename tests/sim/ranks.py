"""Tensor parallelism in the simulation: which KV heads a rank holds, and the all-reduce that
ends every TP forward.

Every cache page of a real rank holds only its share of the heads (kv/nixl/tp_slices.py), and
each of the model's `KV_HEADS` heads (the tiny model's count) belongs to exactly one rank of
an engine (TP <= KV_HEADS here, so none is replicated). A simulated rank keeps one
`PageMemory` per head it holds: a page one rank zeroed, or left unread after a failed load,
is then wrong on that rank only, as a real shard would be. The forward's partial results
meet in an all-reduce, so a wrong read on any rank makes every rank's logits wrong: the
simulated ranks exchange which requests read something wrong, per step, and all sample
the same (wrong) token.
"""

from __future__ import annotations

import asyncio

KV_HEADS = 2


def heads_of(rank: int, tp: int) -> range:
    """The heads rank `rank` of `tp` holds."""
    if not 1 <= tp <= KV_HEADS or KV_HEADS % tp:
        raise ValueError(f"the simulated model's {KV_HEADS} heads cannot be split over {tp} ranks")
    per = KV_HEADS // tp
    return range(rank * per, (rank + 1) * per)


def owner(head: int, tp: int) -> int:
    """The rank of `tp` that holds `head`."""
    return head // (KV_HEADS // tp)


def readers(remote_rank: int, remote_tp: int, local_tp: int) -> int:
    """How many ranks of a `local_tp` engine read from `remote_rank` of a `remote_tp` one:
    the notifications that rank waits for before its pages count as read."""
    return len({owner(h, local_tp) for h in heads_of(remote_rank, remote_tp)})


class Collective:
    """One engine's all-reduce: each rank contributes the requests it read wrong in a step
    and gets the union once every rank has contributed (the ranks wait for each other, as
    a real collective makes them)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._open: dict[int, tuple[list[set[str]], asyncio.Future[set[str]]]] = {}

    async def all_reduce(self, step_id: int, bad: set[str]) -> set[str]:
        if self.size == 1:
            return bad
        parts, done = self._open.setdefault(step_id, ([], asyncio.get_running_loop().create_future()))
        parts.append(bad)
        if len(parts) == self.size:
            del self._open[step_id]
            done.set_result(set().union(*parts))
        return await done
