"""The simulation's own parts: the checks must see a wiped page, a stale Mamba page read as
attention, a wrong state, and a READ that copies what the source holds when it lands."""

from __future__ import annotations

import asyncio
import random

from kv.transfer_params import KVTransferParams
from models.batch import CacheGroup
from tests.sim.content import KV, Mark, PageMemory, Provenance, State, extend_prefix_hashes
from tests.sim.fabric import Fabric, TransferTiming
from tests.sim.forward import ChunkContext, run_chunk
from tests.sim.vclock import run_virtual

BS = 4
HYBRID = (CacheGroup("attention", (1,)), CacheGroup("mamba", (0,)))
DENSE = (CacheGroup("attention", (0,)),)


def ctx(tokens: list[int], blocks: list[list[int]], req_id: str = "r") -> ChunkContext:
    hashes: list[int] = []
    extend_prefix_hashes(hashes, tokens)
    return ChunkContext("e", 0, req_id, tokens, hashes, blocks)


def test_prefix_hashes_name_whole_prefixes() -> None:
    a: list[int] = []
    b: list[int] = []
    extend_prefix_hashes(a, [1, 2, 3])
    extend_prefix_hashes(b, [9, 2, 3])
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # one earlier token changes every later hash


def test_chunks_read_what_earlier_chunks_wrote() -> None:
    mem, prov = PageMemory(8, BS), Provenance()
    c = ctx(list(range(10, 19)), [[0, 1, 2], [5]])
    assert run_chunk(mem, prov, HYBRID, c, 0, 6) == []
    assert run_chunk(mem, prov, HYBRID, c, 6, 9) == []
    assert mem.read_slot(1, 1) == KV(0, c.hashes[5]) and mem.read_state(5) == State(1, c.hashes[8])


def test_a_zeroed_page_is_a_bad_read() -> None:
    mem, prov = PageMemory(8, BS), Provenance()
    c = ctx(list(range(10, 19)), [[0, 1, 2]])
    run_chunk(mem, prov, DENSE, c, 0, 8)
    mem.zero(1)
    bad = run_chunk(mem, prov, DENSE, c, 8, 9)
    assert [b.what for b in bad] == [f"pos {p} (slot {p - 4})" for p in range(4, 8)]
    assert all(b.found_zero and b.block == 1 and b.found == "zero" for b in bad)


def test_stale_mamba_page_poisons_masked_slots_until_zeroed() -> None:
    mem, prov = PageMemory(8, BS), Provenance()
    run_chunk(mem, prov, HYBRID, ctx([1, 2, 3], [[0], [3]], "old"), 0, 3)  # page 3 holds a state
    c = ctx([7, 8], [[3], [4]])
    bad = run_chunk(mem, prov, HYBRID, c, 0, 2)
    assert [b.what for b in bad] == ["masked slot 2 past end 2", "masked slot 3 past end 2"]
    assert mem.read_slot(3, 3) is Mark.GARBAGE
    mem.zero(3)
    assert run_chunk(mem, prov, HYBRID, ctx([7, 8], [[3], [4]]), 0, 2) == []


def test_state_of_another_prefix_is_a_bad_read() -> None:
    mem, prov = PageMemory(8, BS), Provenance()
    run_chunk(mem, prov, HYBRID, ctx([1, 2, 3, 4], [[0], [5]], "a"), 0, 4)
    run_chunk(mem, prov, HYBRID, ctx([1, 2, 3, 9], [[1], [6]], "b"), 0, 4)
    mem.copy_page(mem, 0, 1)  # the attention pages agree on tokens[:3] only
    c = ctx([1, 2, 3, 4, 5], [[1, 2], [6]], "c")
    bad = run_chunk(mem, prov, HYBRID, c, 4, 5)
    assert [b.what for b in bad] == ["state at start 4"]
    assert bad[0].found == "state(g1, b[:4])"


def test_read_copies_the_source_as_it_is_when_it_lands() -> None:
    async def main() -> tuple[list[object], list[str], list[str]]:
        fabric = Fabric(random.Random(0), 0.0, TransferTiming(p_immediate=0.0, p_late=1.0))
        src, dst = PageMemory(4, BS), PageMemory(4, BS)
        prefill = fabric.connect("p", src, lambda: 0)
        decode = fabric.connect("d", dst, lambda: 0)
        src.write_slot(2, 0, KV(0, 111))
        params = KVTransferParams("p", prefill.agent_name, ((2,),), 4, "x")
        decode.start_load("x", params, [[3]], step_id=0)  # the first READ lands at once
        await asyncio.sleep(1e-6)
        first = dst.read_slot(3, 0)
        decode.start_load("y", KVTransferParams("p", prefill.agent_name, ((2,),), 4, "y"), [[1]], step_id=1)
        src.write_slot(2, 0, KV(0, 222))  # freed and reused before the READ lands
        await asyncio.sleep(0.05)
        return (
            [first, dst.read_slot(1, 0)],
            sorted(prefill.get_finished().sending),
            sorted(decode.get_finished().recving),
        )

    contents, sending, recving = run_virtual(main())
    assert contents == [KV(0, 111), KV(0, 222)]
    assert sending == ["x", "y"] and recving == ["x", "y"]


def test_a_failed_read_reports_the_unread_blocks() -> None:
    async def main() -> dict[str, list[int]]:
        fabric = Fabric(random.Random(0), 1.0, TransferTiming())
        prefill = fabric.connect("p", PageMemory(8, BS), lambda: 0)
        decode = fabric.connect("d", PageMemory(8, BS), lambda: 0)
        ok = KVTransferParams("p", prefill.agent_name, ((0,), (1,)), 4, "first")
        decode.start_load("first", ok, [[0], [1]], step_id=0)  # a run's first READ never fails
        params = KVTransferParams("p", prefill.agent_name, ((0, 1, 2), (3,)), 12, "z")
        decode.start_load("z", params, [[4, 5, 6], [7]], step_id=1)
        await asyncio.sleep(0.05)
        return decode.get_finished().failed

    assert run_virtual(main()) == {"z": [5, 6, 7]}  # half the attention blocks read, the state not
