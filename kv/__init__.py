"""KV-cache bookkeeping on the scheduler side: block pool, per-group block tables,
prefix cache and the list of fresh attention blocks to zero."""

from __future__ import annotations

from kv.block_pool import BlockPool, KVBlock
from kv.kv_cache_manager import KVCacheManager

__all__ = ["BlockPool", "KVBlock", "KVCacheManager"]
