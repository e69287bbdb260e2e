"""The simulated forward of one request's chunk: check every entry it reads, then write.

For a chunk of tokens [start, end) a real forward reads, per attention group, the K/V of
positions [0, start) and gathers whole blocks up to the one holding position end - 1 (slots
past `end` are masked, but a NaN there still poisons the output); per Mamba group it reads
the state after tokens[:start] (at start == 0 the state is overwritten, whatever it held).
It then writes K/V for [start, end) and the state after tokens[:end]. Any entry that is not
exactly what the token history implies is a `BadRead`, and the token sampled from it is
wrong on purpose, so a bad read is visible in the output as well as in the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv.cache_group import CacheGroup, cdiv
from tests.sim.content import KV, Mark, PageMemory, Provenance, State, describe_page


@dataclass(frozen=True, slots=True)
class BadRead:
    engine: str
    step: int
    req_id: str
    group: int
    block: int
    what: str  # "pos 7 (slot 3)", "masked slot 2 past end 9", "state at start 12"
    expected: str
    found: str
    found_zero: bool  # the entry had been zeroed: the signature of a wipe after a load

    def __str__(self) -> str:
        return (
            f"BAD READ {self.engine} step {self.step} request {self.req_id} group {self.group} "
            f"block {self.block} {self.what}: expected {self.expected}, found {self.found}"
        )


@dataclass(slots=True)
class ChunkContext:
    engine: str
    step: int
    req_id: str
    tokens: Sequence[int]
    hashes: Sequence[int]  # hashes[p] identifies tokens[:p+1]
    block_ids: Sequence[Sequence[int]]


def run_chunk(
    mem: PageMemory, prov: Provenance, groups: Sequence[CacheGroup], ctx: ChunkContext, start: int, end: int
) -> list[BadRead]:
    """Check the reads of tokens [start, end), then write their K/V and the new state."""
    bad: list[BadRead] = []
    for g, group in enumerate(groups):
        if group.kind == "attention":
            bad.extend(_check_attention(mem, prov, g, ctx, start, end))
        else:
            bad.extend(_check_state(mem, prov, g, ctx, start))
    for g, group in enumerate(groups):
        blocks = ctx.block_ids[g]
        if group.kind == "attention":
            for pos in range(start, end):
                mem.write_slot(blocks[pos // mem.block_size], pos % mem.block_size, KV(g, ctx.hashes[pos]))
        else:
            mem.write_state(blocks[0], State(g, ctx.hashes[end - 1]))
    for pos in range(start, end):
        prov.name(ctx.hashes[pos], ctx.req_id, pos + 1)
    return bad


def _check_attention(
    mem: PageMemory, prov: Provenance, g: int, ctx: ChunkContext, start: int, end: int
) -> list[BadRead]:
    bs = mem.block_size
    blocks = ctx.block_ids[g]
    used = cdiv(end, bs)
    if len(blocks) < used:  # the real batch builder refuses this step
        raise ValueError(f"step {ctx.step}: request {ctx.req_id} has {len(blocks)} blocks in group {g}, needs {used}")
    bad: list[BadRead] = []
    for pos in range(start):
        block, slot = blocks[pos // bs], pos % bs
        found = mem.read_slot(block, slot)
        want = KV(g, ctx.hashes[pos])
        if found != want:
            bad.append(
                BadRead(
                    ctx.engine,
                    ctx.step,
                    ctx.req_id,
                    g,
                    block,
                    f"pos {pos} (slot {slot})",
                    f"kv(g{g}, {ctx.req_id}[:{pos + 1}])",
                    prov.describe(found),
                    found is Mark.ZERO,
                )
            )
    for pos in range(end, used * bs):
        block, slot = blocks[pos // bs], pos % bs
        if mem.read_slot(block, slot) is Mark.GARBAGE:
            bad.append(
                BadRead(
                    ctx.engine,
                    ctx.step,
                    ctx.req_id,
                    g,
                    block,
                    f"masked slot {slot} past end {end}",
                    "no NaN-capable bits",
                    "garbage (stale Mamba state)",
                    False,
                )
            )
    return bad


def _check_state(mem: PageMemory, prov: Provenance, g: int, ctx: ChunkContext, start: int) -> list[BadRead]:
    if start == 0:
        return []
    block = ctx.block_ids[g][0]
    found = mem.read_state(block)
    want = State(g, ctx.hashes[start - 1])
    if found == want:
        return []
    return [
        BadRead(
            ctx.engine,
            ctx.step,
            ctx.req_id,
            g,
            block,
            f"state at start {start}",
            f"state(g{g}, {ctx.req_id}[:{start}])",
            describe_page(prov, found),
            not isinstance(found, State) and all(s is Mark.ZERO for s in found),
        )
    ]
