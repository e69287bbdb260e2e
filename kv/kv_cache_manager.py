"""The scheduler's view of KV memory: block tables for every layer group over one pool,
the prefix cache, and the list of fresh attention blocks the workers must zero.

Zero bookkeeping (docs/design.md §1, §10): a page may have held fp32 Mamba state before it
is handed to an attention group, and stale bits can read as NaN, so every block newly
taken from the pool for an attention group is recorded and drained each step by
`take_blocks_to_zero`. The scheduler removes from that list the blocks a remote KV load
will fill (`get_zeroing_block_ids_in_range`), since zeroing queued behind a running
forward could land after the transfer and wipe it.

Hybrid prefix caching (docs/design.md §21): a state group (Mamba2, Gated DeltaNet) keeps
checkpoints, copies of the state after chosen block boundaries, and a hit is the longest
prefix whose attention blocks are all cached AND whose state checkpoint at exactly that
boundary is cached in every state group. The workers copy state pages, never zero them: the
copies a step needs (`take_state_copies`) travel in its `SchedulerOutput`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kv.block_hash import extend_block_hashes
from kv.block_pool import BlockPool, IntegrityError, KVBlock
from kv.cache_group import CacheGroup
from kv.single_type_manager import FullAttentionManager, MambaManager, SingleTypeManager

logger = logging.getLogger(__name__)

# The default checkpoint policy: every 4th block boundary, and each prompt's last full block.
DEFAULT_CHECKPOINT_INTERVAL = 4


@dataclass(slots=True)
class _Checkpoint:
    """State pages (one per state group) a request saves its state after `boundary` tokens
    into. Published once the copy has shipped (a hit found later reads it in a later step,
    behind it on the compute stream) and the boundary's block hash is known (under async
    scheduling a decode step's input token is known only after the step before reports)."""

    boundary: int
    pages: list[KVBlock]
    shipped: bool = False
    published: bool = False
    dead: bool = False  # the step that was to fill it failed: never published
    by_load: bool = False  # filled by a decode engine's KV load, not by a copy: shipped when it lands


@dataclass(slots=True)
class _ReqCheckpoints:
    saved: list[_Checkpoint] = field(default_factory=list)
    hit: list[KVBlock] = field(default_factory=list)  # the checkpoint its hit starts from, per state group
    hit_tokens: int = 0


class KVCacheManager:
    def __init__(
        self,
        groups: Sequence[CacheGroup],
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
        max_checkpoint_pages: int | None = None,
    ) -> None:
        if not groups:
            raise ValueError("at least one KV cache group is required")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.groups = tuple(groups)
        self.block_size = block_size
        self._has_mamba = any(g.kind == "mamba" for g in self.groups)
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be at least 1 block, got {checkpoint_interval}")
        self.checkpoint_interval = checkpoint_interval
        # Pages running requests may hold as saved checkpoints; beyond it a boundary is not kept.
        self.max_checkpoint_pages = num_blocks // 4 if max_checkpoint_pages is None else max_checkpoint_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            (FullAttentionManager if g.kind == "attention" else MambaManager)(self.pool, block_size, group_id)
            for group_id, g in enumerate(self.groups)
        )
        self._attention = tuple(m for m in self.managers if isinstance(m, FullAttentionManager))
        self._state = tuple(m for m in self.managers if isinstance(m, MambaManager))
        self.checkpointing = enable_prefix_caching and bool(self._state)
        if self.checkpointing:
            logger.info(
                "hybrid prefix caching: a state checkpoint (one page per state group, %d groups) every "
                "%d blocks and at each prompt's last full block; running requests hold at most %d "
                "checkpoint pages, the rest are evictable like cached blocks",
                len(self._state),
                checkpoint_interval,
                self.max_checkpoint_pages,
            )
        self._checkpoints: dict[str, _ReqCheckpoints] = {}
        self._checkpoint_pages_held = 0  # saved pages of requests not yet freed
        # This step's state copies: (checkpoint, slot) before its forward, (slot, checkpoint) after.
        # A freed request's copies not shipped yet are dropped (its slot may go to another).
        self._restores: list[tuple[str, int, int]] = []
        self._saves: list[tuple[str, int, int]] = []
        # Fresh attention block ids awaiting zeroing -> owning request, in allocation
        # order (a dict keeps order and refuses duplicates).
        self._blocks_to_zero: dict[int, str] = {}
        # Full-block hashes per request, extended as the request grows.
        self._req_hashes: dict[str, list[bytes]] = {}
        # Per request, the full blocks already published to the prefix cache: a decode step
        # that completes no block asks `has_new_full_block` and skips building its tokens.
        # Every attention group publishes the same blocks (one block size, the same hashes,
        # the same hits), so the first one's count stands for all.
        self._published: Mapping[str, int] = self._attention[0].num_cached if self._attention else {}
        # Prefix-hit token count found by get_computed_blocks, for allocate_slots.
        self._pending_hits: dict[str, int] = {}
        # Per request, the tokens its blocks cover in every group: a decode step within
        # them needs no block, which allocate_slots answers without asking each group
        # (at 256 running that check is most of a step's scheduling).
        self._covered: dict[str, int] = {}

    # -- properties -------------------------------------------------------------

    @property
    def zeroes_new_blocks(self) -> bool:
        """Only hybrid models share pages between Mamba state and attention K/V; a
        dense model's pages only ever held K/V of the same dtype, so never NaN bits."""
        return self._has_mamba

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_requests(self) -> int:
        return len(self.managers[0].req_to_blocks)

    # -- allocation ---------------------------------------------------------------

    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` found in the prefix cache (whole blocks, all groups).

        Never the whole prompt: the last token must run through the model to produce
        logits, so the hit stops at the last block boundary strictly below the length.
        The hit is remembered for the next `allocate_slots` of this request; call that
        before any other allocation could evict the hit blocks.
        """
        if not self.enable_prefix_caching:
            return 0
        if req_id in self.managers[0].req_to_blocks:
            raise ValueError(f"request {req_id} already owns blocks")
        # A head-of-queue request waiting for memory is looked up every step: hash it once.
        hashes = extend_block_hashes(self._req_hashes.get(req_id, []), token_ids, self.block_size)
        self._req_hashes[req_id] = hashes
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        num_hit = min((len(m.find_longest_cache_hit(hashes[:max_blocks])) for m in self._attention), default=max_blocks)
        # A hybrid hit also needs the state after exactly that block, in every state group.
        while num_hit and not all(m.find_checkpoint(hashes[num_hit - 1]) for m in self._state):
            num_hit -= 1
        self._pending_hits[req_id] = num_hit * self.block_size
        return num_hit * self.block_size

    @property
    def covered(self) -> Mapping[str, int]:
        """Per request, the tokens its blocks hold in every group (read only): the scheduler's
        decode loop looks a request up here instead of calling `fits` for each."""
        return self._covered

    def fits(self, req_id: str, num_tokens_total: int) -> bool:
        """Whether the request's blocks already hold `num_tokens_total` tokens in every group,
        so `allocate_slots` would take nothing: the scheduler asks this first for a decode step."""
        return num_tokens_total <= self._covered.get(req_id, -1)

    def allocate_slots(
        self, req_id: str, num_tokens_total: int, num_new_computed_tokens: int = 0
    ) -> tuple[list[int], ...] | None:
        """Make `req_id` own blocks for `num_tokens_total` tokens in every group.

        `num_new_computed_tokens` is the prefix hit just returned by
        `get_computed_blocks` (0 to take none); it must be block aligned. Returns the
        ids newly taken from the pool, one list per group (prefix hits excluded, use
        `get_block_ids` for whole tables), or None, changing nothing, when the pool
        cannot satisfy the request.
        """
        if not num_new_computed_tokens and self.fits(req_id, num_tokens_total):
            # The common decode step: the next token fits the blocks the request owns.
            return tuple([] for _ in self.managers)
        if num_tokens_total < num_new_computed_tokens:
            raise ValueError(f"num_tokens_total {num_tokens_total} < prefix hit {num_new_computed_tokens}")
        hits, states = self._take_hit_blocks(req_id, num_new_computed_tokens) if num_new_computed_tokens else ({}, [])
        needs = [m.get_num_blocks_to_allocate(req_id, num_tokens_total) for m in self.managers]
        if not hits and not any(needs):
            return tuple([] for _ in self.managers)
        if hits:
            num_new = sum(max(need - len(hits.get(i, ())), 0) for i, need in enumerate(needs))
            # A hit block sitting in the free queue is counted as free but stops being
            # free once touched, so it cannot also serve as a new block.
            num_new += sum(1 for blocks in hits.values() for b in blocks if b.ref_cnt == 0)
            num_new += sum(1 for b in states if b.ref_cnt == 0)
        else:
            num_new = sum(needs)
        if num_new > self.pool.num_free_blocks:
            return None

        self._pending_hits.pop(req_id, None)
        for group_id, blocks in hits.items():
            manager = self.managers[group_id]
            assert isinstance(manager, FullAttentionManager)
            manager.add_cached_blocks(req_id, blocks)
        for manager, block in zip(self._state, states):
            manager.hold_checkpoint(req_id, block)
            entry = self._checkpoints.setdefault(req_id, _ReqCheckpoints())
            entry.hit.append(block)
            entry.hit_tokens = num_new_computed_tokens
        new_ids: list[list[int]] = []
        for manager, need in zip(self.managers, needs):
            if not need:
                # A group needing nothing before the hits needs nothing after: a decode step
                # crossing an attention block boundary leaves the Mamba slot alone.
                new_ids.append([])
                continue
            if hits:  # they cover part of what it needed
                need = manager.get_num_blocks_to_allocate(req_id, num_tokens_total)
            ids = manager.allocate_new_blocks(req_id, need)
            if manager.zeroes_new_blocks:
                # Prefix hits never get here: their content is valid and must stay.
                for block_id in ids:
                    self._blocks_to_zero[block_id] = req_id
            new_ids.append(ids)
        self._covered[req_id] = min([m.num_tokens_covered(req_id) for m in self.managers])
        return tuple(new_ids)

    def _take_hit_blocks(self, req_id: str, num_tokens: int) -> tuple[dict[int, list[KVBlock]], list[KVBlock]]:
        """The cached blocks covering the first `num_tokens` tokens, per attention
        group id, and the state checkpoint after them per state group, looked up again so a
        hit evicted since `get_computed_blocks` is caught instead of silently reused with
        someone else's content."""
        if num_tokens == 0:
            return {}, []
        if num_tokens % self.block_size:
            raise ValueError(f"prefix hit of {num_tokens} tokens is not block aligned")
        if num_tokens > self._pending_hits.get(req_id, 0):
            raise ValueError(
                f"request {req_id}: prefix hit of {num_tokens} tokens was not found by get_computed_blocks"
            )
        hashes = self._req_hashes[req_id][: num_tokens // self.block_size]
        hits: dict[int, list[KVBlock]] = {}
        for manager in self._attention:
            blocks = manager.find_longest_cache_hit(hashes)
            if len(blocks) < len(hashes):
                raise RuntimeError(f"request {req_id}: prefix-hit blocks were evicted before allocate_slots")
            hits[manager.group_id] = blocks
        states = [m.find_checkpoint(hashes[-1]) for m in self._state]
        found = [b for b in states if b is not None]
        if len(found) < len(states):
            raise RuntimeError(f"request {req_id}: prefix-hit state checkpoints were evicted before allocate_slots")
        return hits, found

    def has_new_full_block(self, req_id: str, num_computed_tokens: int) -> bool:
        """Whether `cache_full_blocks` up to `num_computed_tokens` would publish a block not
        yet published (prefix caching on)."""
        return num_computed_tokens // self.block_size > self._published.get(req_id, 0)

    def cache_full_blocks(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish the request's computed full blocks for later prefix hits. Call it
        once `num_computed_tokens` tokens of `token_ids` have really been computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        hashes = self._req_hashes.setdefault(req_id, [])
        if len(hashes) < num_full:
            extend_block_hashes(hashes, token_ids[: num_full * self.block_size], self.block_size)
        for manager in self._attention:
            manager.cache_blocks(req_id, hashes, num_full)
        if req_id in self._checkpoints:
            self._publish_checkpoints(req_id)

    # -- state checkpoints (docs/design.md §21) -------------------------------------------

    def next_checkpoint(self, num_computed: int, num_prompt_tokens: int) -> int:
        """The first checkpoint boundary past `num_computed` tokens (a multiple of the
        interval, or the prompt's last full block): a prefill chunk ends there, so the state
        after it exists to be copied. 0 when nothing is checkpointed."""
        if not self.checkpointing:
            return 0
        every = self.checkpoint_interval * self.block_size
        boundary = (num_computed // every + 1) * every
        last = (num_prompt_tokens - 1) // self.block_size * self.block_size
        return last if num_computed < last < boundary else boundary

    def is_checkpoint(self, num_tokens: int, num_prompt_tokens: int) -> bool:
        """Whether the policy keeps the state after `num_tokens` tokens."""
        if not self.checkpointing or num_tokens <= 0 or num_tokens % self.block_size:
            return False
        if num_tokens % (self.checkpoint_interval * self.block_size) == 0:
            return True
        return num_tokens == (num_prompt_tokens - 1) // self.block_size * self.block_size

    def has_checkpoint(self, req_id: str, num_tokens: int) -> bool:
        """Whether the state after the request's first `num_tokens` tokens is cached already
        (as far as its hashes are known), so no chunk needs to end there to keep it."""
        hashes = self._req_hashes.get(req_id, ())
        index = num_tokens // self.block_size - 1
        return 0 <= index < len(hashes) and all(m.find_checkpoint(hashes[index]) for m in self._state)

    def checkpoint(self, req_id: str, num_tokens: int, token_ids: Sequence[int], before_forward: bool = False) -> bool:
        """Save the request's state after `num_tokens` tokens, which the step being scheduled
        computes up to exactly, into fresh pages: the copies go after the step's forward
        (`take_state_copies`), or before it when the slot holds that state already (a decode
        engine's loaded prompt, whose READ has ended). Skipped (False) when the boundary is cached already, the pool
        has no free page, or running requests hold `max_checkpoint_pages`."""
        if num_tokens % self.block_size:
            raise ValueError(f"checkpoint at {num_tokens} tokens is not block aligned")
        num_pages = len(self._state)
        if self._checkpoint_pages_held + num_pages > self.max_checkpoint_pages:
            return False
        if num_pages > self.pool.num_free_blocks:
            return False
        hashes = self._req_hashes.setdefault(req_id, [])
        extend_block_hashes(hashes, token_ids[:num_tokens], self.block_size)
        index = num_tokens // self.block_size - 1
        if index < len(hashes) and all(m.find_checkpoint(hashes[index]) for m in self._state):
            return False
        entry = self._checkpoints.setdefault(req_id, _ReqCheckpoints())
        if any(c.boundary == num_tokens and not c.dead for c in entry.saved):
            return False  # a resumed request passing a boundary it saved already
        pages = [m.new_checkpoint(req_id) for m in self._state]
        copies = self._restores if before_forward else self._saves
        copies.extend((req_id, m.slot(req_id), page.block_id) for m, page in zip(self._state, pages))
        entry.saved.append(_Checkpoint(num_tokens, pages))
        self._checkpoint_pages_held += num_pages
        return True

    def restore_state(self, req_id: str) -> None:
        """The request computes on from its prefix hit: copy the hit's checkpoint into its own
        slot before the step's forward (the cached page itself is never written)."""
        entry = self._checkpoints.get(req_id)
        if entry is None or not entry.hit:
            raise ValueError(f"request {req_id} holds no state checkpoint to start from")
        self._restores.extend((req_id, page.block_id, m.slot(req_id)) for m, page in zip(self._state, entry.hit))

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Drain this step's state copies, (source, destination) page ids: restores to run
        before its forward, saves after. Saves now ship, so their checkpoints may be
        published: a hit found from the next step on reads them behind this step."""
        restores = [(src, dst) for _, src, dst in self._restores]
        saves = [(src, dst) for _, src, dst in self._saves]
        self._restores, self._saves = [], []
        if restores or saves:
            for req_id, entry in self._checkpoints.items():
                if any(not c.shipped and not c.by_load for c in entry.saved):
                    for c in entry.saved:
                        c.shipped = c.shipped or not c.by_load
                    self._publish_checkpoints(req_id)
        return restores, saves

    def hand_over_checkpoint(self, req_id: str, num_tokens: int) -> tuple[int, tuple[int, ...]]:
        """Prefill side: the request's longest published checkpoint within its first
        `num_tokens` tokens (one it saved, or the one its hit started from), as (boundary,
        page per state group), for the decode side to load beside the prompt and cache;
        (0, ()) if none. The request holds those pages until it is freed."""
        entry = self._checkpoints.get(req_id)
        if entry is None:
            return 0, ()
        best = (entry.hit_tokens, tuple(b.block_id for b in entry.hit)) if entry.hit else (0, ())
        for c in entry.saved:
            if c.published and not c.dead and best[0] < c.boundary <= num_tokens:
                best = (c.boundary, tuple(b.block_id for b in c.pages))
        return best

    def adopt_checkpoint(self, req_id: str, num_tokens: int, token_ids: Sequence[int]) -> list[int]:
        """Decode side: fresh pages for a checkpoint after `num_tokens` tokens that a load
        fills, published when it lands (`load_ended`); none (skipped) when it is cached
        already, no page is free, or the cap is reached."""
        if not self.checkpointing or num_tokens % self.block_size or num_tokens <= 0:
            return []
        if self._checkpoint_pages_held + len(self._state) > self.max_checkpoint_pages:
            return []
        if len(self._state) > self.pool.num_free_blocks:
            return []
        hashes = self._req_hashes.setdefault(req_id, [])
        extend_block_hashes(hashes, token_ids[:num_tokens], self.block_size)
        if all(m.find_checkpoint(hashes[num_tokens // self.block_size - 1]) for m in self._state):
            return []
        pages = [m.new_checkpoint(req_id) for m in self._state]
        entry = self._checkpoints.setdefault(req_id, _ReqCheckpoints())
        entry.saved.append(_Checkpoint(num_tokens, pages, by_load=True))
        self._checkpoint_pages_held += len(pages)
        return [p.block_id for p in pages]

    def load_ended(self, req_id: str, ok: bool) -> None:
        """Decode side: the load that filled the request's adopted checkpoints ended; publish
        them if it landed (the pages hold the prefill side's bytes), never if it failed."""
        entry = self._checkpoints.get(req_id)
        for c in entry.saved if entry is not None else ():
            if c.by_load and not c.shipped:
                c.shipped = True
                c.dead = c.dead or not ok
        if entry is not None:
            self._publish_checkpoints(req_id)

    def _publish_checkpoints(self, req_id: str) -> None:
        hashes = self._req_hashes.get(req_id, [])
        for c in self._checkpoints[req_id].saved:
            index = c.boundary // self.block_size - 1
            if c.shipped and not c.published and not c.dead and index < len(hashes):
                for manager, page in zip(self._state, c.pages):
                    manager.publish_checkpoint(page, hashes[index])
                c.published = True

    def free(self, req_id: str) -> None:
        """Return every block of the request to the pool. Its ids not yet taken for
        zeroing are dropped: a block may be reallocated before the next take, and
        zeroing it then would wipe the new owner's data (it is recorded again if it
        goes to an attention group)."""
        self.forget_blocks_to_zero(req_id)
        for manager in self.managers:
            manager.free(req_id)
        self._req_hashes.pop(req_id, None)
        self._pending_hits.pop(req_id, None)
        self._covered.pop(req_id, None)
        entry = self._checkpoints.pop(req_id, None)
        if entry is not None:
            self._checkpoint_pages_held -= sum(len(c.pages) for c in entry.saved)
            self._restores = [c for c in self._restores if c[0] != req_id]
            self._saves = [c for c in self._saves if c[0] != req_id]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while any block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        self._req_hashes.clear()
        self._pending_hits.clear()
        return True

    # -- zero bookkeeping ------------------------------------------------------------

    def take_blocks_to_zero(self) -> dict[int, str]:
        """Drain the blocks to zero, in the order they were recorded, with each one's owner:
        attention blocks newly allocated, and blocks re-recorded after a failed load. The
        step that zeroes a block uses it: its owner's blocks are not freed before it reports."""
        taken, self._blocks_to_zero = self._blocks_to_zero, {}
        return taken

    def forget_blocks_to_zero(self, req_id: str) -> None:
        """Drop the request's blocks not yet taken for zeroing: it will not compute into them
        (it finished), and a block handed to an attention group again is recorded again."""
        for block_id in [b for b, owner in self._blocks_to_zero.items() if owner == req_id]:
            del self._blocks_to_zero[block_id]

    def uncache_blocks(self, req_id: str, start_token: int, end_token: int) -> set[str]:
        """Withdraw from the prefix cache the request's blocks covering tokens
        [start_token, end_token), whose KV a failed step never wrote, and name the other
        requests that already share any of them (through a prefix hit): their KV is wrong too."""
        blocks = [
            b for m in self._attention for b in m.req_to_blocks.get(req_id, [])[m.block_span(start_token, end_token)]
        ]
        entry = self._checkpoints.get(req_id)
        for c in entry.saved if entry is not None else ():
            if start_token < c.boundary <= end_token:
                c.dead = True
                blocks.extend(c.pages)
        self.pool.uncache(blocks)
        ids = {b.block_id for b in blocks if b.ref_cnt > 1}
        return {
            r
            for m in self.managers
            for r, bs in m.req_to_blocks.items()
            if r != req_id and any(b.block_id in ids for b in bs)
        } | {r for r, e in self._checkpoints.items() if r != req_id and any(b.block_id in ids for b in e.hit)}

    def get_zeroing_block_ids_in_range(self, req_id: str, start_token: int, end_token: int) -> list[int]:
        """Attention block ids that a remote load of tokens [start_token, end_token)
        overwrites (each manager's `block_span`)."""
        return [bid for m in self._attention for bid in m.block_ids_in_range(req_id, start_token, end_token)]

    def record_blocks_for_zeroing(self, req_id: str, start_token: int) -> None:
        """Record every attention block from `start_token` on for zeroing (a failed
        load: the valid prefix before it is kept, the rest is recomputed)."""
        if start_token % self.block_size:
            raise ValueError(f"start_token {start_token} is not block aligned")
        first = start_token // self.block_size
        blocks = [b for m in self._attention for b in m.req_to_blocks.get(req_id, [])[first:]]
        # A block shared through the prefix cache holds another request's valid KV;
        # only the failed load's own blocks, past the local hit, may be zeroed.
        shared = [b.block_id for b in blocks if b.ref_cnt > 1]
        if shared:
            raise ValueError(f"request {req_id}: blocks {shared} are shared, not zeroable")
        for block in blocks:
            self._blocks_to_zero.setdefault(block.block_id, req_id)

    # -- inspection ----------------------------------------------------------------------

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(req_id) for m in self.managers)

    def check_integrity(self) -> None:
        """Pool integrity, plus: each block's ref_cnt equals the number of tables that
        hold it, a block held more than once is a prefix-cache block, and pending
        zeroing ids belong to their recorded owner."""
        self.pool.check_integrity()
        owners: Counter[int] = Counter()
        for manager in self.managers:
            for blocks in manager.req_to_blocks.values():
                owners.update(b.block_id for b in blocks)
            if isinstance(manager, MambaManager):
                for blocks in manager.req_checkpoints.values():
                    owners.update(b.block_id for b in blocks)
        held = sum(len(c.pages) for e in self._checkpoints.values() for c in e.saved)
        if held != self._checkpoint_pages_held:
            raise IntegrityError(f"{held} saved checkpoint pages held, counted {self._checkpoint_pages_held}")
        for block in self.pool.blocks:
            count = owners[block.block_id]
            if block.ref_cnt != count:
                raise IntegrityError(f"block {block.block_id} has ref_cnt {block.ref_cnt} but {count} owners")
            if count > 1 and block.block_hash is None:
                raise IntegrityError(f"block {block.block_id} is owned {count} times but is not a cached block")
        for block_id, req_id in self._blocks_to_zero.items():
            if not any(block_id in m.block_ids(req_id) for m in self._attention):
                raise IntegrityError(f"block {block_id} pending zeroing is not held by {req_id}")
