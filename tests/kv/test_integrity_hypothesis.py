"""Random request lifecycles against the KV cache manager, with a shadow of the zero list.

Token ids come from a 2-letter alphabet and blocks are 2-4 tokens, so prefix hits,
shared blocks and evictions of cached blocks happen often. On hybrid configurations requests
also save state checkpoints at random block boundaries, and a shadow of what each checkpoint
page holds checks that a hit always restores the state after exactly its own prefix: a hit's
state length equals its attention length (docs/design.md §21).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv.cache_group import CacheGroup
from kv.kv_cache_manager import KVCacheManager

ATT = CacheGroup("attention", (0,))
ATT2 = CacheGroup("attention", (2,))
MAMBA = CacheGroup("mamba", (1,))
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=10)


class KVLifecycle(RuleBasedStateMachine):
    groups: tuple[CacheGroup, ...] = (ATT,)
    block_size = 2
    num_blocks = 10

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.groups, self.num_blocks, self.block_size, True)
        self.attention = [i for i, g in enumerate(self.groups) if g.kind == "attention"]
        self.tokens: dict[str, list[int]] = {}
        self.prompts: list[list[int]] = []
        self.next_id = 0
        # What take_blocks_to_zero must return next: fresh attention blocks (and blocks
        # recorded after a failed load), in order, minus those of freed requests.
        self.expected_zero: dict[int, str] = {}
        # Checkpoint page -> the tokens whose state it holds (forgotten when the page is reused).
        self.state_of: dict[int, tuple[int, ...]] = {}
        self.hybrid = any(g.kind == "mamba" for g in self.groups)

    def _allocate(self, req_id: str, num_tokens: int, hit: int) -> bool:
        before = self.kv.get_block_ids(req_id)
        new_ids = self.kv.allocate_slots(req_id, num_tokens, hit)
        if new_ids is None:
            assert self.kv.get_block_ids(req_id) == before
            return False
        after = self.kv.get_block_ids(req_id)
        # A hit shares attention blocks; a state group's one slot is always fresh.
        first_new = [max(len(b), hit // self.block_size if g in self.attention else 0) for g, b in enumerate(before)]
        fresh = [after[g][first_new[g] :] for g in range(len(self.groups))]
        assert list(new_ids) == fresh
        for block_id in (b for ids in fresh for b in ids):
            self.state_of.pop(block_id, None)
        for g in self.attention:
            self.expected_zero.update(dict.fromkeys(fresh[g], req_id))
        return True

    @rule(tokens=TOKENS, use_hit=st.sampled_from([True, True, False]))
    def add(self, tokens: list[int], use_hit: bool) -> None:
        self._add(tokens, use_hit)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), extra=TOKENS)
    def add_repeat(self, data: st.DataObject, extra: list[int]) -> None:
        """A prompt sharing an earlier one's prefix: hits, often on freed blocks."""
        prompt = data.draw(st.sampled_from(self.prompts))
        self._add(prompt + extra[: data.draw(st.integers(0, 3))], True)

    def _add(self, tokens: list[int], use_hit: bool) -> None:
        self.prompts.append(tokens)
        req_id = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.get_computed_blocks(req_id, tokens)
        assert hit % self.block_size == 0 and hit < len(tokens)
        if not self._allocate(req_id, len(tokens), hit if use_hit else 0):
            self.kv.free(req_id)  # forgets the remembered hit
            return
        self.tokens[req_id] = tokens
        self.kv.cache_full_blocks(req_id, tokens, len(tokens))
        if use_hit and hit and self.hybrid:
            self.kv.restore_state(req_id)
            restores, _ = self.kv.take_state_copies()
            slots = {ids[0] for g, ids in enumerate(self.kv.get_block_ids(req_id)) if g not in self.attention}
            assert len(restores) == len(slots) and {dst for _, dst in restores} == slots
            for src, _ in restores:
                assert self.state_of.get(src) == tuple(tokens[:hit]), "a hit restored a state of another prefix"
        if self.hybrid and len(tokens) > self.block_size:
            self._checkpoint(req_id, (len(tokens) - 1) // self.block_size * self.block_size)

    @precondition(lambda self: self.tokens and self.hybrid)
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[req_id]
        num_blocks = len(tokens) // self.block_size
        if not num_blocks:
            return
        self._checkpoint(req_id, data.draw(st.integers(1, num_blocks)) * self.block_size)

    def _checkpoint(self, req_id: str, boundary: int) -> None:
        tokens = self.tokens[req_id]
        saved = self.kv.checkpoint(req_id, boundary, tokens)
        _, saves = self.kv.take_state_copies()
        assert len(saves) == (len(self.groups) - len(self.attention) if saved else 0)
        for _, page in saves:
            self.state_of[page] = tuple(tokens[:boundary])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=TOKENS)
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[req_id] + extra[:3]
        if self._allocate(req_id, len(tokens), 0):
            self.tokens[req_id] = tokens
            self.kv.cache_full_blocks(req_id, tokens, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(req_id)
        del self.tokens[req_id]
        self.expected_zero = {b: r for b, r in self.expected_zero.items() if r != req_id}

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), block_index=st.integers(0, 5))
    def record_failed_load(self, data: st.DataObject, block_index: int) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tables = self.kv.get_block_ids(req_id)
        blocks = [b for g in self.attention for b in tables[g][block_index:]]
        if any(self.kv.pool.blocks[b].ref_cnt > 1 for b in blocks):
            with pytest.raises(ValueError):
                self.kv.record_blocks_for_zeroing(req_id, block_index * self.block_size)
            return
        self.kv.record_blocks_for_zeroing(req_id, block_index * self.block_size)
        for block_id in blocks:
            self.expected_zero.setdefault(block_id, req_id)

    @rule()
    def take(self) -> None:
        taken = list(self.kv.take_blocks_to_zero())
        assert taken == list(self.expected_zero)
        self.expected_zero.clear()
        mamba_blocks = {
            b
            for req_id in self.tokens
            for g, ids in enumerate(self.kv.get_block_ids(req_id))
            if g not in self.attention
            for b in ids
        }
        assert not set(taken) & mamba_blocks

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        assert self.kv.num_requests == len(self.tokens)

    def teardown(self) -> None:
        for req_id in list(self.tokens):
            self.kv.free(req_id)
        assert list(self.kv.take_blocks_to_zero()) == []
        assert self.kv.num_free_blocks == self.num_blocks
        self.kv.check_integrity()


def _machine(groups: tuple[CacheGroup, ...], block_size: int) -> type[KVLifecycle]:
    return type("Machine", (KVLifecycle,), {"groups": groups, "block_size": block_size})


CONFIGS = {
    "dense": _machine((ATT,), 2),
    "two_attention_groups": _machine((ATT, ATT2), 3),
    "hybrid": _machine((ATT, MAMBA), 2),
    "hybrid_mamba_first": _machine((MAMBA, ATT, ATT2), 4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_lifecycles_keep_the_cache_consistent(name: str) -> None:
    machine = CONFIGS[name]
    machine.TestCase.settings = settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
