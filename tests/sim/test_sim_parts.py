"""The simulation's own parts: the checks must see a wiped page, a stale Mamba page read as
attention, a wrong state, and a READ that copies what the source holds when it lands."""

from __future__ import annotations

import asyncio
import random

from engine.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from kv.cache_group import CacheGroup
from kv.nixl.transfer_params import KVTransferParams
from tests.engine.fake_worker import VOCAB, next_token
from tests.sim.content import KV, Mark, PageMemory, Provenance, State, extend_prefix_hashes
from tests.sim.fabric import Fabric, TransferTiming
from tests.sim.forward import ChunkContext, run_chunk
from tests.sim.ranks import Collective, heads_of
from tests.sim.sim_worker import SimWorker
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


def shard(num_blocks: int, rank: int = 0, tp: int = 1) -> dict[int, PageMemory]:
    """The pages of every head rank `rank` of `tp` holds."""
    return {h: PageMemory(num_blocks, BS) for h in heads_of(rank, tp)}


def test_read_copies_the_source_as_it_is_when_it_lands() -> None:
    async def main() -> tuple[list[object], list[str], list[str]]:
        fabric = Fabric(random.Random(0), 0.0, TransferTiming(p_immediate=0.0, p_late=1.0))
        src, dst = shard(4), shard(4)
        prefill = fabric.connect("p", 0, 1, src, lambda: 0)
        decode = fabric.connect("d", 0, 1, dst, lambda: 0)
        src[1].write_slot(2, 0, KV(0, 111))
        params = KVTransferParams("p", prefill.agent_name, ((2,),), 4, "x")
        decode.start_load("x", params, [[3]], step_id=0)  # the first READ lands at once
        await asyncio.sleep(1e-6)
        first = dst[1].read_slot(3, 0)
        decode.start_load("y", KVTransferParams("p", prefill.agent_name, ((2,),), 4, "y"), [[1]], step_id=1)
        src[1].write_slot(2, 0, KV(0, 222))  # freed and reused before the READ lands
        await asyncio.sleep(0.05)
        return (
            [first, dst[1].read_slot(1, 0)],
            sorted(prefill.get_finished().sending),
            sorted(decode.get_finished().recving),
        )

    contents, sending, recving = run_virtual(main())
    assert contents == [KV(0, 111), KV(0, 222)]
    assert sending == ["x", "y"] and recving == ["x", "y"]


def test_a_failed_read_reports_the_unread_blocks() -> None:
    async def main() -> dict[str, list[int]]:
        fabric = Fabric(random.Random(0), 1.0, TransferTiming())
        prefill = fabric.connect("p", 0, 1, shard(8), lambda: 0)
        decode = fabric.connect("d", 0, 1, shard(8), lambda: 0)
        ok = KVTransferParams("p", prefill.agent_name, ((0,), (1,)), 4, "first")
        decode.start_load("first", ok, [[0], [1]], step_id=0)  # a run's first READ never fails
        params = KVTransferParams("p", prefill.agent_name, ((0, 1, 2), (3,)), 12, "z")
        decode.start_load("z", params, [[4, 5, 6], [7]], step_id=1)
        await asyncio.sleep(0.05)
        return decode.get_finished().failed

    assert run_virtual(main()) == {"z": [5, 6, 7]}  # half the attention blocks read, the state not


def test_tp_reads_take_each_head_from_its_rank_and_count_the_readers() -> None:
    """Prefill TP 2 to decode TP 1: the decode rank reads head h from prefill rank h, and each
    prefill rank is read once. Prefill TP 1 to decode TP 2: the prefill rank's pages count as
    read only once both decode ranks have notified."""

    async def main() -> tuple[list[object], list[list[str]], list[str], list[str]]:
        fabric = Fabric(random.Random(0), 0.0, TransferTiming(p_immediate=1.0))
        wide = [fabric.connect("p2", r, 2, shard(4, r, 2), lambda: 0) for r in range(2)]
        for r, rank in enumerate(wide):
            rank.memories[r].write_slot(1, 0, KV(0, 100 + r))
        one = fabric.connect("d1", 0, 1, shard(4), lambda: 0)
        one.start_load("a", KVTransferParams("p2", wide[0].agent_name, ((1,),), 4, "a"), [[2]], step_id=0)
        await asyncio.sleep(1e-6)
        read = [one.memories[h].read_slot(2, 0) for h in (0, 1)]
        sent = [sorted(rank.get_finished().sending) for rank in wide]
        narrow = fabric.connect("p1", 0, 1, shard(4), lambda: 0)
        split = [fabric.connect("d2", r, 2, shard(4, r, 2), lambda: 0) for r in range(2)]
        params = KVTransferParams("p1", narrow.agent_name, ((1,),), 4, "b")
        split[0].start_load("b", params, [[3]], step_id=0)
        await asyncio.sleep(1e-6)
        after_one = sorted(narrow.get_finished().sending)
        split[1].start_load("b", params, [[3]], step_id=0)
        await asyncio.sleep(1e-6)
        return read, sent, after_one, sorted(narrow.get_finished().sending)

    read, sent, after_one, after_both = run_virtual(main())
    assert read == [KV(0, 100), KV(0, 101)]
    assert sent == [["a"], ["a"]]
    assert after_one == [] and after_both == ["b"]


def test_a_page_wiped_on_one_rank_makes_every_rank_sample_wrong() -> None:
    """Each rank checks only its own heads' pages; the all-reduce then gives every rank the
    same wrong token, as a real TP forward over one bad shard would."""

    async def main() -> list[list[dict[str, int]]]:
        collective = Collective(2)
        ranks = [
            SimWorker("e", DENSE, 8, BS, Provenance(), random.Random(r), (0.0, 0.0), rank=r, collective=collective)
            for r in range(2)
        ]
        prompt = [11, 12, 13, 14, 15]
        sp = SamplingParams(max_tokens=3, temperature=0.0)
        steps = [
            SchedulerOutput(0, [NewRequestData("r", prompt, sp, [[0, 1]], 0)], [], {"r": 5}, [], None),
            SchedulerOutput(1, [], [CachedRequestData("r", 5, [[]])], {"r": 1}, [], None),
        ]
        sampled = []
        for out in steps:
            results = await asyncio.gather(*(asyncio.wrap_future(w.execute_model(out)) for w in ranks))
            sampled.append([res.sampled for res in results])
            ranks[1].memories[1].zero(0)  # rank 1's shard of block 0 lost, rank 0's intact
        for w in ranks:
            await w.close()
        return sampled

    first, second = run_virtual(main())
    assert first[0] == first[1] == {"r": next_token([11, 12, 13, 14, 15])}
    history = [11, 12, 13, 14, 15, first[0]["r"]]
    assert second[0] == second[1] == {"r": (next_token(history) + 1) % VOCAB}
