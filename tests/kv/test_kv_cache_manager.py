from __future__ import annotations

import logging

import pytest

from kv.cache_group import CacheGroup
from kv.kv_cache_manager import KVCacheManager

ATT = CacheGroup("attention", (0,))
ATT2 = CacheGroup("attention", (2,))
MAMBA = CacheGroup("mamba", (1,))


def flat(per_group):
    """allocate_slots' new ids, all groups in group order."""
    return [b for ids in per_group for b in ids]


def make(groups=(ATT, MAMBA), num_blocks: int = 10, block_size: int = 2, caching: bool = False):
    return KVCacheManager(list(groups), num_blocks, block_size, caching)


@pytest.mark.parametrize(
    ("block_size", "num_tokens", "num_attention_blocks"),
    [(2, 1, 1), (2, 4, 2), (2, 5, 3), (4, 9, 3), (4, 16, 4)],
)
def test_allocation_covers_tokens_in_every_group(block_size, num_tokens, num_attention_blocks):
    kv = make(num_blocks=10, block_size=block_size)
    new_ids = flat(kv.allocate_slots("a", num_tokens))
    att, mamba = kv.get_block_ids("a")
    assert len(att) == num_attention_blocks and len(mamba) == 1
    assert new_ids == att + mamba
    assert kv.num_free_blocks == 10 - num_attention_blocks - 1
    assert kv.num_requests == 1
    kv.check_integrity()


def test_growing_returns_only_new_blocks_and_mamba_stays_one_slot():
    kv = make()
    first = flat(kv.allocate_slots("a", 3))
    assert flat(kv.allocate_slots("a", 4)) == []
    grown = flat(kv.allocate_slots("a", 7))
    att, mamba = kv.get_block_ids("a")
    assert len(grown) == 2 and att[2:] == grown and len(mamba) == 1
    assert first == att[:2] + mamba


def test_exhaustion_returns_none_and_changes_nothing():
    kv = make(num_blocks=10, block_size=2)
    assert kv.allocate_slots("a", 14) is not None  # 7 attention + 1 mamba
    pending = list(kv.take_blocks_to_zero())
    kv.allocate_slots("a", 16)  # one more attention block: 1 free left
    before = (kv.num_free_blocks, kv.get_block_ids("a"), kv.num_requests)
    assert kv.allocate_slots("b", 2) is None  # 1 attention + 1 mamba > 1 free
    assert kv.allocate_slots("a", 20) is None
    assert (kv.num_free_blocks, kv.get_block_ids("a"), kv.num_requests) == before
    assert kv.get_block_ids("b") == ([], [])
    assert len(pending) == 7 and len(list(kv.take_blocks_to_zero())) == 1
    kv.check_integrity()


def test_free_reverses_so_tails_are_evicted_first():
    kv = make(groups=(ATT,), num_blocks=4, block_size=2)
    kv.allocate_slots("a", 8)
    assert kv.get_block_ids("a") == ([0, 1, 2, 3],)
    kv.free("a")
    kv.allocate_slots("b", 2)
    assert kv.get_block_ids("b") == ([3],)
    kv.free("b")
    kv.free("b")  # idempotent
    kv.free("never-seen")
    assert kv.num_free_blocks == 4 and kv.num_requests == 0
    kv.check_integrity()


@pytest.mark.parametrize(
    ("prompt_b", "expected_hit"),
    [
        ([1, 2, 3, 4, 5, 6, 7], 6),  # same prompt: capped below its length
        ([1, 2, 3, 4, 5, 6], 4),  # prompt ends on a cached boundary: last block recomputed
        ([1, 2, 3, 4, 9, 9, 9, 9], 4),  # diverges in the third block
        ([9, 2, 3, 4, 5, 6, 7], 0),  # diverges in the first block
        ([1], 0),
    ],
)
def test_second_request_reuses_the_shared_prefix(prompt_b, expected_hit):
    kv = make(groups=(ATT,), num_blocks=10, block_size=2, caching=True)
    prompt_a = [1, 2, 3, 4, 5, 6, 7]
    assert kv.get_computed_blocks("a", prompt_a) == 0
    kv.allocate_slots("a", len(prompt_a))
    list(kv.take_blocks_to_zero())
    kv.cache_full_blocks("a", prompt_a, len(prompt_a))

    hit = kv.get_computed_blocks("b", prompt_b)
    assert hit == expected_hit
    new_ids = flat(kv.allocate_slots("b", len(prompt_b), hit))
    (a_ids,), (b_ids,) = kv.get_block_ids("a"), kv.get_block_ids("b")
    num_hit_blocks = hit // 2
    assert b_ids[:num_hit_blocks] == a_ids[:num_hit_blocks]
    assert new_ids == b_ids[num_hit_blocks:]
    # Only the fresh blocks are zeroed: the shared ones hold valid K/V.
    assert list(kv.take_blocks_to_zero()) == new_ids
    for block_id in a_ids[:num_hit_blocks]:
        assert kv.pool.blocks[block_id].ref_cnt == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_hit_on_free_cached_blocks_counts_them_as_taken_and_evicts_a_tail():
    kv = make(groups=(ATT,), num_blocks=4, block_size=2, caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", prompt, 8)
    kv.free("a")  # free queue 3, 2, 1, 0, all cached
    list(kv.take_blocks_to_zero())

    hit = kv.get_computed_blocks("b", prompt)
    assert hit == 6  # blocks 0, 1, 2
    # 5 blocks: 3 hits + 2 new. Four are free, but three of them are the hits.
    assert kv.allocate_slots("b", 10, hit) is None
    assert kv.num_free_blocks == 4
    assert flat(kv.allocate_slots("b", 8, hit)) == [3]
    assert kv.pool.blocks[3].block_hash is None  # evicted: its hash left the map
    assert kv.get_block_ids("b") == ([0, 1, 2, 3],)
    assert list(kv.take_blocks_to_zero()) == [3]
    kv.check_integrity()


def test_hit_evicted_before_allocate_raises():
    kv = make(groups=(ATT,), num_blocks=4, block_size=2, caching=True)
    prompt = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", 5)
    kv.cache_full_blocks("a", prompt, 5)
    kv.free("a")
    hit = kv.get_computed_blocks("b", prompt)
    assert hit == 4
    kv.allocate_slots("c", 8)  # takes every free block, evicting b's hits
    with pytest.raises(RuntimeError):
        kv.allocate_slots("b", 5, hit)


def test_bad_prefix_hit_arguments_raise():
    kv = make(groups=(ATT,), caching=True)
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 8, 4)  # no get_computed_blocks hit
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 8, 3)  # not block aligned
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 2, 4)  # fewer tokens than the hit


def test_hybrid_hit_needs_the_state_checkpoint_at_exactly_that_boundary(caplog):
    with caplog.at_level(logging.INFO, logger="kv.kv_cache_manager"):
        kv = make(groups=(ATT, MAMBA), num_blocks=12, caching=True)
    assert kv.enable_prefix_caching and kv.checkpointing
    assert sum("state checkpoint" in r.message for r in caplog.records) == 1
    tokens = [1, 2, 3, 4, 5, 6, 7]
    kv.allocate_slots("a", 7)
    kv.cache_full_blocks("a", tokens, 7)
    # Attention blocks without a checkpoint are no hit for a hybrid.
    assert kv.get_computed_blocks("b", tokens) == 0
    assert kv.checkpoint("a", 2, tokens)
    (slot,) = kv.get_block_ids("a")[1]
    restores, saves = kv.take_state_copies()
    assert restores == [] and len(saves) == 1 and saves[0][0] == slot
    assert kv.get_computed_blocks("b", tokens) == 2  # blocks 0-2 cached, the state only after block 0
    assert kv.checkpoint("a", 6, tokens)
    kv.take_state_copies()
    assert kv.get_computed_blocks("c", tokens) == 6
    assert kv.get_computed_blocks("d", [1, 2, 3, 4, 9, 9, 9]) == 2  # another prefix at 4: no state
    kv.allocate_slots("c", 7, 6)
    kv.restore_state("c")
    (c_slot,) = kv.get_block_ids("c")[1]
    restores, saves = kv.take_state_copies()
    assert restores == [(saves_page := restores[0][0], c_slot)] and saves == []
    assert saves_page != c_slot and saves_page not in kv.get_block_ids("a")[1]
    assert c_slot not in kv.take_blocks_to_zero()  # state pages are never zeroed
    kv.free("a")
    kv.free("c")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_a_checkpoint_is_published_only_once_its_copy_ships():
    kv = make(groups=(ATT, MAMBA), num_blocks=12, caching=True)
    tokens = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", 4)
    kv.cache_full_blocks("a", tokens, 4)
    assert kv.checkpoint("a", 4, tokens)
    # Same step: a hit would restore before the forward that fills the checkpoint.
    assert kv.get_computed_blocks("b", tokens) == 0
    kv.take_state_copies()
    assert kv.get_computed_blocks("b", tokens) == 4


def test_evicting_an_attention_block_shortens_the_hit_to_an_earlier_checkpoint():
    kv = make(groups=(ATT, MAMBA), num_blocks=9, caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    kv.allocate_slots("a", 7)  # attention 0-3, slot 4
    kv.cache_full_blocks("a", tokens, 7)
    kv.checkpoint("a", 2, tokens)
    kv.checkpoint("a", 6, tokens)
    kv.take_state_copies()
    kv.free("a")  # free queue: 7 8, then a's tail first 3 2 1 0, its checkpoints, its slot
    assert kv.get_computed_blocks("b", tokens) == 6
    kv.allocate_slots("x", 6)  # takes 7 8 3 2: the block of tokens 4-5 is evicted
    # Blocks 0-1 are still cached, but there is no state after 4 tokens: the hit is 2 tokens,
    # where a checkpoint is, never 4 tokens of K/V with a state of another length.
    assert kv.get_computed_blocks("b", tokens) == 2
    assert kv.allocate_slots("b", 3, 2) is not None  # its first chunk ends at the next boundary
    kv.restore_state("b")
    restores, _ = kv.take_state_copies()
    assert len(restores) == 1
    kv.free("x")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_a_failed_step_withdraws_its_checkpoints_and_names_who_restored_them():
    kv = make(groups=(ATT, MAMBA), num_blocks=12, caching=True)
    tokens = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", 4)
    kv.cache_full_blocks("a", tokens, 4)
    kv.checkpoint("a", 4, tokens)
    kv.take_state_copies()
    hit = kv.get_computed_blocks("b", tokens)
    kv.allocate_slots("b", 5, hit)
    assert kv.uncache_blocks("a", 0, 4) == {"b"}
    assert kv.get_computed_blocks("c", tokens) == 0
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_a_block_is_offered_for_publishing_once_when_it_fills():
    kv = make(groups=(ATT, ATT2), caching=True)
    tokens = [1, 2, 3, 4, 5, 6]
    kv.allocate_slots("a", 6)
    assert not kv.has_new_full_block("a", 1)
    assert kv.has_new_full_block("a", 2)
    kv.cache_full_blocks("a", tokens, 3)
    assert not kv.has_new_full_block("a", 3)
    assert kv.has_new_full_block("a", 4)
    kv.cache_full_blocks("a", tokens, 6)
    assert not kv.has_new_full_block("a", 6)
    assert kv.get_computed_blocks("b", tokens + [7]) == 6
    kv.free("a")
    assert kv.has_new_full_block("a", 2)  # a new request under the same id starts over


@pytest.mark.parametrize(("groups", "needs"), [((ATT,), False), ((ATT, ATT2), False), ((ATT, MAMBA), True)])
def test_zeroes_new_blocks_only_for_hybrid_models(groups, needs):
    assert make(groups=groups).zeroes_new_blocks is needs


def test_pages_move_between_mamba_and_attention_groups():
    kv = make(groups=(ATT, MAMBA), num_blocks=3, block_size=2)
    kv.allocate_slots("a", 4)
    assert kv.get_block_ids("a") == ([0, 1], [2])
    assert list(kv.take_blocks_to_zero()) == [0, 1]
    kv.free("a")  # free queue: 1, 0 (attention, reversed), 2 (mamba)
    kv.allocate_slots("b", 2)
    # Block 0 held attention K/V and now holds Mamba state: not zeroed.
    assert kv.get_block_ids("b") == ([1], [0])
    assert list(kv.take_blocks_to_zero()) == [1]
    kv.free("b")  # free queue: 2, 1, 0
    kv.allocate_slots("c", 2)
    # Block 2 held fp32 Mamba state and now holds attention K/V: zeroed.
    assert kv.get_block_ids("c") == ([2], [1])
    assert list(kv.take_blocks_to_zero()) == [2]
    kv.check_integrity()


def test_zero_list_holds_new_attention_blocks_of_every_group_and_take_drains():
    kv = make(groups=(ATT, MAMBA, ATT2), num_blocks=10, block_size=2)
    kv.allocate_slots("a", 3)
    att, mamba, att2 = kv.get_block_ids("a")
    assert list(kv.take_blocks_to_zero()) == att + att2
    assert list(kv.take_blocks_to_zero()) == []
    kv.allocate_slots("b", 1)
    kv.allocate_slots("a", 5)
    b_att, _, b_att2 = kv.get_block_ids("b")
    att, _, att2 = kv.get_block_ids("a")
    taken = list(kv.take_blocks_to_zero())
    assert taken == b_att + b_att2 + [att[2], att2[2]]
    assert not set(taken) & set(mamba + kv.get_block_ids("b")[1])


def test_ids_of_a_request_freed_before_take_are_dropped_then_recorded_again():
    kv = make(groups=(ATT, MAMBA), num_blocks=10, block_size=2)
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 2)
    a_att = kv.get_block_ids("a")[0]
    kv.free("a")
    assert list(kv.take_blocks_to_zero()) == kv.get_block_ids("b")[0]
    kv.check_integrity()
    # Taking every free block hands a's old attention pages out again: recorded anew.
    kv.allocate_slots("c", 2 * (kv.num_free_blocks - 1))
    assert set(a_att) <= set(kv.get_block_ids("c")[0])
    assert list(kv.take_blocks_to_zero()) == kv.get_block_ids("c")[0]


@pytest.mark.parametrize(
    ("start", "end", "indices"),
    [
        (0, 14, [0, 1, 2, 3]),
        (0, 5, [0, 1]),  # ends mid-block: the partial block is written too
        (4, 8, [1]),
        (8, 13, [2, 3]),  # starts after a local prefix hit of two blocks
        (6, 6, []),
        (9, 3, []),
    ],
)
def test_zeroing_range_slices_attention_blocks(start, end, indices):
    kv = make(groups=(ATT, MAMBA), num_blocks=10, block_size=4)
    kv.allocate_slots("a", 14)
    att, _ = kv.get_block_ids("a")
    assert kv.get_zeroing_block_ids_in_range("a", start, end) == [att[i] for i in indices]


def test_remote_load_after_local_hit_covers_exactly_the_fresh_blocks():
    kv = make(groups=(ATT,), num_blocks=10, block_size=4, caching=True)
    local = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    kv.allocate_slots("a", 9)
    kv.cache_full_blocks("a", local, 9)
    list(kv.take_blocks_to_zero())
    prompt = local[:8] + list(range(20, 30))  # 18 tokens
    hit = kv.get_computed_blocks("b", prompt)
    assert hit == 8
    num_external = 9  # the last prompt token is recomputed locally
    kv.allocate_slots("b", hit + num_external + 1, hit)
    skip = set(kv.get_zeroing_block_ids_in_range("b", hit, hit + num_external))
    (b_ids,) = kv.get_block_ids("b")
    assert skip == set(b_ids[2:5])
    fresh = list(kv.take_blocks_to_zero())
    assert fresh == b_ids[2:]
    assert [i for i in fresh if i not in skip] == []


def test_record_blocks_for_zeroing_from_an_aligned_token():
    kv = make(groups=(ATT, MAMBA), num_blocks=10, block_size=4)
    kv.allocate_slots("a", 12)
    list(kv.take_blocks_to_zero())
    att, _ = kv.get_block_ids("a")
    kv.record_blocks_for_zeroing("a", 4)
    assert list(kv.take_blocks_to_zero()) == att[1:]
    kv.record_blocks_for_zeroing("a", 12)
    assert list(kv.take_blocks_to_zero()) == []
    with pytest.raises(ValueError):
        kv.record_blocks_for_zeroing("a", 5)
    kv.record_blocks_for_zeroing("a", 0)
    kv.free("a")
    assert list(kv.take_blocks_to_zero()) == []


def test_record_blocks_for_zeroing_refuses_shared_blocks():
    kv = make(groups=(ATT,), num_blocks=10, block_size=2, caching=True)
    kv.allocate_slots("a", 5)
    kv.cache_full_blocks("a", [1, 2, 3, 4, 5], 5)
    hit = kv.get_computed_blocks("b", [1, 2, 3, 4, 5])
    kv.allocate_slots("b", 5, hit)
    with pytest.raises(ValueError):
        kv.record_blocks_for_zeroing("b", 0)
    kv.record_blocks_for_zeroing("b", hit)


def test_check_integrity_detects_a_block_owned_twice():
    kv = make(groups=(ATT, MAMBA))
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 4)
    kv.check_integrity()
    attention = kv.managers[0]
    attention.req_to_blocks["b"].append(attention.req_to_blocks["a"][0])
    with pytest.raises(AssertionError, match="owners"):
        kv.check_integrity()


def test_check_integrity_detects_a_shared_block_without_hash():
    kv = make(groups=(ATT,))
    kv.allocate_slots("a", 2)
    block = kv.managers[0].req_to_blocks["a"][0]
    block.ref_cnt += 1
    kv.managers[0].req_to_blocks["b"] = [block]
    with pytest.raises(AssertionError, match="not a cached block"):
        kv.check_integrity()


def test_reset_prefix_cache():
    kv = make(groups=(ATT,), caching=True)
    kv.allocate_slots("a", 4)
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5]) == 4
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5]) == 0
    assert kv.usage == 0.0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_num_required_blocks_is_the_span_from_token_zero(block_size):
    """Each manager's shortcut agrees with `block_span`, which the rest of the cache uses."""
    kv = KVCacheManager([ATT, MAMBA], 8, block_size, enable_prefix_caching=False)
    for manager in kv.managers:
        for num_tokens in range(-2, 5 * block_size + 2):
            assert manager.num_required_blocks(num_tokens) == manager.block_span(0, num_tokens).stop


def test_a_loaded_checkpoint_is_cached_once_its_load_lands():
    """PD: the prefill side hands over its longest published checkpoint within the prompt; the
    decode side adopts fresh pages for it and caches them only once the load lands."""
    prefill = make(groups=(ATT, MAMBA), num_blocks=12, caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    prefill.allocate_slots("p", 6)
    prefill.cache_full_blocks("p", tokens, 6)
    prefill.checkpoint("p", 2, tokens)
    prefill.checkpoint("p", 4, tokens)
    assert prefill.hand_over_checkpoint("p", 6) == (0, ())  # the saves have not shipped yet
    prefill.take_state_copies()
    boundary, pages = prefill.hand_over_checkpoint("p", 6)
    assert boundary == 4 and len(pages) == 1 and pages[0] not in prefill.get_block_ids("p")[1]
    decode = make(groups=(ATT, MAMBA), num_blocks=12, caching=True)
    for ok, hit in ((False, 0), (True, 4)):
        decode.allocate_slots("d", 7)
        assert len(decode.adopt_checkpoint("d", 4, tokens)) == 1  # one state group: one page to load
        decode.cache_full_blocks("d", tokens, 7)
        decode.take_state_copies()  # other requests' copies ship: not this page, a load fills it
        assert decode.get_computed_blocks("x", tokens) == 0
        decode.load_ended("d", ok=ok)
        assert decode.get_computed_blocks("x", tokens) == hit
        decode.free("d")
    assert decode.adopt_checkpoint("y", 4, tokens) == []  # cached already: nothing to load
    decode.free("y")
    prefill.free("p")
    for kv in (prefill, decode):
        assert kv.num_free_blocks == kv.num_blocks
        kv.check_integrity()
