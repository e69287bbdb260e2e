from __future__ import annotations

import subprocess
import sys

import pytest

from kv.block_hash import extend_block_hashes, hash_block_tokens
from kv.block_pool import BlockPool


def test_new_blocks_come_from_the_front_with_one_reference() -> None:
    pool = BlockPool(10, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 7
    assert pool.usage == pytest.approx(0.3)
    pool.check_integrity()


@pytest.mark.parametrize("n", [11, 100])
def test_over_allocation_raises_and_changes_nothing(n: int) -> None:
    pool = BlockPool(10, enable_caching=False)
    with pytest.raises(ValueError):
        pool.get_new_blocks(n)
    assert pool.num_free_blocks == 10
    pool.check_integrity()


def test_freed_blocks_join_the_tail_in_the_order_given() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 2, 1, 0]


def test_double_free_raises() -> None:
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.free_blocks([block])


def test_cached_free_block_is_findable_until_evicted() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h-a")
    pool.free_blocks([b, a])  # free queue: 2, 1, 0(a)
    assert pool.get_cached_block(b"h-a") is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([a])
    pool.check_integrity()
    # Taking every free block reaches `a` last; then its hash is gone from the map.
    taken = pool.get_new_blocks(3)
    assert taken[-1] is a and a.block_hash is None
    assert pool.get_cached_block(b"h-a") is None
    pool.check_integrity()


def test_second_block_with_same_hash_stays_anonymous() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"same")
    pool.cache_full_block(b, b"same")
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    pool.check_integrity()


def test_caching_disabled_never_finds_anything() -> None:
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h")
    assert a.block_hash is None and pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_refused_while_blocks_are_used() -> None:
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h")
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and a.block_hash is None
    pool.check_integrity()


def _corrupt_ref_of_free_block(pool: BlockPool) -> None:
    pool.blocks[5].ref_cnt = 1


def _corrupt_leak(pool: BlockPool) -> None:
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0


def _corrupt_stale_hash_entry(pool: BlockPool) -> None:
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h")
    block.block_hash = b"other"


def _corrupt_wrong_free_key(pool: BlockPool) -> None:
    used = pool.get_new_blocks(2)
    pool._free[used[0].block_id] = used[1]
    used[1].ref_cnt = 0


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_ref_of_free_block, _corrupt_leak, _corrupt_stale_hash_entry, _corrupt_wrong_free_key],
)
def test_check_integrity_detects_corruption(corrupt) -> None:
    pool = BlockPool(10, enable_caching=True)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_request_hashes_cover_full_blocks_and_chain(block_size: int) -> None:
    tokens = list(range(10))
    hashes = extend_block_hashes([], tokens, block_size)
    assert len(hashes) == 10 // block_size
    assert hashes[0] == hash_block_tokens(None, tokens[:block_size])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[block_size : 2 * block_size])
    # Same second block behind a different first block: a different hash.
    other = extend_block_hashes([], [99] + tokens[1:], block_size)
    assert other[1] != hashes[1]


def test_hashes_are_equal_across_processes() -> None:
    code = "from kv.block_hash import hash_block_tokens as h; print(h(b'p', [1, 2, 70000]).hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hash_block_tokens(b"p", [1, 2, 70000]).hex()
