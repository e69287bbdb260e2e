"""Prefix-cache hashes of full token blocks.

A block's hash chains its parent's hash, so equal hashes mean equal whole prefixes,
not just equal blocks. sha256 over a fixed byte layout (not Python's `hash`, which is
salted per process) keeps the hashes equal across processes and machines.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Marks whether a parent hash precedes the tokens, so a root block's token bytes can
# never be read as some parent hash followed by fewer tokens.
_ROOT = b"\x00"
_CHILD = b"\x01"


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    data = _ROOT if parent is None else _CHILD + parent
    return hashlib.sha256(data + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Append to `hashes` (those of the first len(hashes) blocks) the hashes of the
    remaining full blocks of `token_ids`, so a growing request is hashed only once. A
    partial tail is skipped because its content will still change."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def with_group(block_hash: bytes, group_id: int) -> bytes:
    """The cache key of a block in one layer group: each attention group keeps its own
    pages for the same tokens, so the same prefix is cached once per group."""
    return block_hash + group_id.to_bytes(4, "little")
