"""One pool of KV pages shared by every layer group, with an eviction-ordered free queue
and a prefix-cache hash map.

Attention and Mamba groups draw from the same pool on purpose: a page freed by one
group can be handed to the other. That is why newly allocated attention pages must be
zeroed (left-over fp32 Mamba state read as bf16 can be NaN); the bookkeeping for it
lives in the KV cache manager, not here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


class IntegrityError(AssertionError):
    """A cache's bookkeeping contradicts itself. Raised explicitly, not by `assert`, so the
    check holds under `python -O` too; an AssertionError all the same, since it is one."""


@dataclass(slots=True)
class KVBlock:
    """A page of KV memory as the scheduler sees it.

    `block_hash` is set once the page holds a full, computed block that later requests
    may reuse; it survives a free so the page stays findable until it is evicted.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Free queue, reference counts and the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front = next to be taken. Freed blocks join at the tail, so a cached block
        # freed recently survives longest (LRU). Keyed by id for O(1) removal on a hit.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        # Bumped whenever a hash becomes findable or stops being so: an engine's routing
        # summary (engine/summary.py) resends its digest only when this moved.
        self.cache_version = 0

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including cached ones that a new allocation may evict."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise ValueError(f"need {n} free blocks, only {len(self._free)} left")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks that reach 0 join the free tail
        in the order given (callers give a request's blocks tail first, so the tail of
        a prompt, the least likely to be shared, is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit that was free leaves the queue
        so no allocation can evict it while it is in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a computed full block findable. If another block already holds this
        hash (two requests computed the same prefix at once) the first one stays the
        cached copy and this block stays anonymous: it is freed like any other."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.cache_version += 1

    def cached_hashes(self) -> Iterable[bytes]:
        """The keys of every findable block (a layer group's suffix included, kv/block_hash.py)."""
        return self._cached.keys()

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while blocks are in use: a shared
        block owned by running requests must keep its identity."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.cache_version += 1
        return True

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Make blocks unfindable again (their content turned out wrong); they stay allocated."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.cache_version += 1
        block.block_hash = None

    def check_integrity(self) -> None:
        """Raise IntegrityError describing the first inconsistency found."""
        for block_id, block in self._free.items():
            if block is not self.blocks[block_id]:
                raise IntegrityError(f"free queue key {block_id} holds block {block.block_id}")
            if block.ref_cnt != 0:
                raise IntegrityError(f"block {block_id} is free with ref_cnt {block.ref_cnt}")
        for block in self.blocks:
            if block.block_id not in self._free and block.ref_cnt <= 0:
                raise IntegrityError(
                    f"block {block.block_id} is neither free nor referenced (ref_cnt {block.ref_cnt}): leaked"
                )
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if num_used + len(self._free) != self.num_blocks:
            raise IntegrityError(f"free {len(self._free)} + used {num_used} != total {self.num_blocks}")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise IntegrityError(f"hash map entry points to block {block.block_id} carrying another hash")
        for block in self.blocks:
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise IntegrityError(f"block {block.block_id} carries a hash the map does not know")
