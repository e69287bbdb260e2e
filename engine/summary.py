"""What an engine tells the routers about itself: its load and which prompt prefixes it holds.

The ingress routes by these summaries (api/routing/, docs/design.md §22) instead of asking every
engine about every request. A summary is pulled periodically; the cached-block digest is sent
only when the engine's prefix cache changed since the version the caller already holds, so an
idle fleet's polls carry a few integers. Each cached block is named by the first 8 bytes of its
chained hash (kv/block_hash.py): a collision between two prefixes can only make the router
guess a hit that the engine then misses, which costs time, never correctness.

A hybrid model's hit also needs the state checkpoint after its last block (docs/design.md §21),
so its engine sends the digests of the blocks it holds a checkpoint after apart from those of
its attention blocks, and the routers count a hit only up to the last checkpointed block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

DIGEST_BYTES = 8
GROUP_BYTES = 4


def digest_of(block_hash: bytes) -> int:
    """A cached block's name in a summary (and on the ingress, for a prompt's blocks)."""
    return int.from_bytes(block_hash[:DIGEST_BYTES], "little")


@dataclass(frozen=True, slots=True)
class EngineSummary:
    """One engine's load and cache, as of one poll.

    `cached` is None when the cache is unchanged since the version the caller named: the
    caller keeps the digest it has. `waiting_tokens` counts the prompt tokens of waiting
    requests not yet computed: the prefill work queued ahead of a new request."""

    num_running: int
    num_waiting: int
    waiting_tokens: int
    num_blocks_free: int
    num_blocks_total: int
    block_size: int
    max_num_batched_tokens: int
    cache_version: int
    cached: frozenset[int] | None
    # Hybrid models: the blocks a state checkpoint follows, sent along with `cached`; None on a
    # model without state layers, whose hits need none.
    checkpoints: frozenset[int] | None = None


def summarize(scheduler: Scheduler, since_version: int | None) -> EngineSummary:
    """The scheduler's summary; the digest only when the cache moved past `since_version`."""
    kv = scheduler.kv
    version = kv.pool.cache_version
    state_groups = {i for i, g in enumerate(kv.groups) if g.kind == "mamba"}
    cached = checkpoints = None
    if since_version != version:
        blocks: set[int] = set()
        states: set[int] = set()
        for key in kv.pool.cached_hashes() if kv.enable_prefix_caching else ():
            group = int.from_bytes(key[-GROUP_BYTES:], "little")  # kv/block_hash.py `with_group`
            (states if group in state_groups else blocks).add(digest_of(key))
        cached = frozenset(blocks)
        checkpoints = frozenset(states) if state_groups else None
    return EngineSummary(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        waiting_tokens=sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in scheduler.waiting),
        num_blocks_free=kv.num_free_blocks,
        num_blocks_total=kv.num_blocks,
        block_size=kv.block_size,
        max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
        cache_version=version,
        cached=cached,
        checkpoints=checkpoints,
    )
