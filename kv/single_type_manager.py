"""Per-layer-group block tables: how many blocks a kind of layer needs for a request.

All managers draw from one shared `BlockPool`; the difference between kinds is only
how many blocks a request needs and whether fresh blocks must be zeroed.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kv.block_hash import with_group
from kv.block_pool import BlockPool, KVBlock
from kv.cache_group import cdiv


class SingleTypeManager(ABC):
    """Block tables of one layer group. Tables are append-only while a request lives:
    workers index them by position, so a block never moves or disappears mid-request."""

    # True when a page newly taken from the pool must be zeroed before first use.
    zeroes_new_blocks: ClassVar[bool]

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

    @abstractmethod
    def block_span(self, start_token: int, end_token: int) -> slice:
        """Where in a request's table the blocks holding tokens [start_token, end_token) are:
        what a load of those tokens writes, what a failed step leaves unwritten."""

    def num_required_blocks(self, num_tokens: int) -> int:
        """Blocks a request with `num_tokens` tokens must own in this group."""
        return self.block_span(0, num_tokens).stop

    def block_ids_in_range(self, req_id: str, start_token: int, end_token: int) -> list[int]:
        return self.block_ids(req_id)[self.block_span(start_token, end_token)]

    @abstractmethod
    def num_tokens_covered(self, req_id: str) -> int:
        """The most tokens the request's table covers without another block."""

    def get_num_blocks_to_allocate(self, req_id: str, num_tokens: int) -> int:
        owned = len(self.req_to_blocks.get(req_id, ()))
        return max(self.num_required_blocks(num_tokens) - owned, 0)

    def allocate_new_blocks(self, req_id: str, num_new: int) -> list[int]:
        """Append `num_new` fresh blocks to the request's table (`get_num_blocks_to_allocate`
        says how many); returns their ids. Raises ValueError (from the pool) if it cannot,
        leaving the table unchanged."""
        new_blocks = self.pool.get_new_blocks(num_new)
        self.req_to_blocks.setdefault(req_id, []).extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, req_id: str) -> None:
        # Reverse order: the tail of a prompt is the least likely prefix to be shared,
        # so it should be evicted before the head.
        blocks = self.req_to_blocks.pop(req_id, [])
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]


class FullAttentionManager(SingleTypeManager):
    """One block per `block_size` tokens; full blocks can be shared by prefix caching."""

    zeroes_new_blocks = True

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        super().__init__(pool, block_size, group_id)
        # How many leading blocks of each request are already in the hash map, so
        # caching after every step only looks at blocks that just became full.
        self._num_cached: dict[str, int] = {}

    @property
    def num_cached(self) -> Mapping[str, int]:
        """Per request, the leading blocks already in the hash map (read only)."""
        return self._num_cached

    def num_tokens_covered(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ())) * self.block_size

    def block_span(self, start_token: int, end_token: int) -> slice:
        if start_token >= end_token:
            return slice(0, 0)
        return slice(start_token // self.block_size, cdiv(end_token, self.block_size))

    def num_required_blocks(self, num_tokens: int) -> int:
        # `block_span(0, num_tokens).stop` without the slice: asked for every request that
        # crosses into a new block, every step.
        return cdiv(num_tokens, self.block_size) if num_tokens > 0 else 0

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes]) -> list[KVBlock]:
        """Cached blocks for the longest prefix of `block_hashes`; the chain stops at
        the first miss because a later block is only valid behind its own prefix."""
        hits = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(with_group(block_hash, self.group_id))
            if block is None:
                break
            hits.append(block)
        return hits

    def add_cached_blocks(self, req_id: str, blocks: Sequence[KVBlock]) -> None:
        """Start a request's table with prefix-cache hits (touching them)."""
        if self.req_to_blocks.get(req_id):
            raise ValueError(f"request {req_id} already owns blocks; hits go first")
        self.pool.touch(blocks)
        self.req_to_blocks[req_id] = list(blocks)
        self._num_cached[req_id] = len(blocks)

    def cache_blocks(self, req_id: str, block_hashes: Sequence[bytes], num_full_blocks: int) -> None:
        """Publish the request's first `num_full_blocks` blocks (computed, full) under
        `block_hashes` so later requests can hit them."""
        blocks = self.req_to_blocks.get(req_id, [])
        end = min(num_full_blocks, len(blocks), len(block_hashes))
        start = self._num_cached.get(req_id, 0)
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], with_group(block_hashes[i], self.group_id))
        self._num_cached[req_id] = max(start, end)

    def free(self, req_id: str) -> None:
        self._num_cached.pop(req_id, None)
        super().free(req_id)


class MambaManager(SingleTypeManager):
    """One state slot per request, whatever its length: the state is overwritten in place
    each step. Fresh slots are not zeroed (the state is fully rewritten).

    Prefix caching keeps state checkpoints (docs/design.md §21): a page holding a copy of
    the state after a block boundary, cached under that boundary's block hash and this
    group's id. A request holds the checkpoint pages it saved and the one its hit starts
    from until it is freed (so a page is never reallocated while a copy into or out of it
    may still be queued); freed, they stay findable until evicted, like attention blocks."""

    zeroes_new_blocks = False

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        super().__init__(pool, block_size, group_id)
        self.req_checkpoints: dict[str, list[KVBlock]] = {}

    def num_tokens_covered(self, req_id: str) -> int:
        return sys.maxsize if self.req_to_blocks.get(req_id) else 0

    def block_span(self, start_token: int, end_token: int) -> slice:
        # The one state slot holds whatever prefix was computed last, whatever the range.
        return slice(0, 1) if start_token < end_token else slice(0, 0)

    def num_required_blocks(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0  # `block_span(0, num_tokens).stop`, as for attention

    def find_checkpoint(self, block_hash: bytes) -> KVBlock | None:
        """The cached state after the block whose (chained) hash is `block_hash`."""
        return self.pool.get_cached_block(with_group(block_hash, self.group_id))

    def hold_checkpoint(self, req_id: str, block: KVBlock) -> None:
        """The request starts from this cached checkpoint (touched: it cannot be evicted)."""
        self.pool.touch([block])
        self.req_checkpoints.setdefault(req_id, []).append(block)

    def new_checkpoint(self, req_id: str) -> KVBlock:
        """A fresh page for the request to save its state into (published later)."""
        (block,) = self.pool.get_new_blocks(1)
        self.req_checkpoints.setdefault(req_id, []).append(block)
        return block

    def publish_checkpoint(self, block: KVBlock, block_hash: bytes) -> None:
        self.pool.cache_full_block(block, with_group(block_hash, self.group_id))

    def slot(self, req_id: str) -> int:
        return self.req_to_blocks[req_id][0].block_id

    def free(self, req_id: str) -> None:
        self.pool.free_blocks(reversed(self.req_checkpoints.pop(req_id, [])))
        super().free(req_id)
