"""The NIXL descriptors of what a READ moves: whole pages from a remote rank of the same TP
size, head slices from one of another (kv/nixl/worker.py).

Memory. A KV cache is a list of byte buffers `[num_blocks, page_bytes]` (kv/cache_buffers.py);
block b is row b of every buffer, so a block is one page per buffer. Buffers are registered
once, and one descriptor per (buffer, block) page is prepared once, locally and per peer
(`Pages.descs`): index = buffer * num_blocks + block. A load is then two index lists
(`page_indices`). A rank of another TP size holds other heads in each page, so this rank
reads only its head slices of them (kv/nixl/tp_slices.py), with descriptors made per READ
(`slice_descs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv.nixl.tp_slices import Piece

Pairs = list[list[tuple[int, int]]]  # (local, remote) block pairs, per cache group


@dataclass(frozen=True, slots=True)
class Pages:
    """One rank's registered KV memory: a buffer per base address, of `num_blocks` pages each."""

    base_addrs: tuple[int, ...]
    page_bytes: int
    num_blocks: int
    device_id: int

    def descs(self) -> np.ndarray:
        """Rows (address, length, device) of every page, buffer by buffer."""
        offsets = np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.page_bytes)
        rows = np.empty((len(self.base_addrs) * self.num_blocks, 3), dtype=np.uint64)
        for i, base in enumerate(self.base_addrs):
            rows[i * self.num_blocks : (i + 1) * self.num_blocks, 0] = np.uint64(base) + offsets
        rows[:, 1] = self.page_bytes
        rows[:, 2] = self.device_id
        return rows


def _rows(addrs: np.ndarray, length: int, device_id: int) -> np.ndarray:
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, length, device_id
    return rows


def reads_any(pairs: Pairs, pieces: Sequence[tuple[Piece, ...]] | None) -> bool:
    """Whether a READ from a remote rank moves anything: some block pair of whole pages
    (`pieces` None), or of a group with head slices (`pieces[group]`) to read there."""
    if pieces is None:
        return any(pairs)
    return any(group and slices for slices, group in zip(pieces, pairs))


def page_indices(local: Pages, remote: Pages, pairs: Pairs) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the prepared page lists of every buffer's pages of these blocks."""
    mine = np.asarray([a for group in pairs for a, _ in group], dtype=np.int64)
    theirs = np.asarray([b for group in pairs for _, b in group], dtype=np.int64)
    buffers = np.arange(len(local.base_addrs), dtype=np.int64)[:, None]
    local_idx = (buffers * local.num_blocks + mine).ravel().astype(np.int32)
    remote_idx = (buffers * remote.num_blocks + theirs).ravel().astype(np.int32)
    return local_idx, remote_idx


def slice_descs(
    local: Pages, remote: Pages, pieces: Sequence[tuple[Piece, ...]], pairs: Pairs
) -> tuple[np.ndarray, np.ndarray]:
    """(address, length, device) rows, local and remote, of this rank's head slices
    (`pieces[group]`) of the remote rank's pages: per group, buffer, block pair and piece."""
    local_rows: list[np.ndarray] = []
    remote_rows: list[np.ndarray] = []
    for slices, group in zip(pieces, pairs):
        if not group or not slices:
            continue
        mine = np.asarray([a for a, _ in group], dtype=np.uint64)
        theirs = np.asarray([b for _, b in group], dtype=np.uint64)
        for base, remote_base in zip(local.base_addrs, remote.base_addrs):
            for piece in slices:
                local_rows.append(
                    _rows(
                        base + mine * np.uint64(local.page_bytes) + np.uint64(piece.local),
                        piece.length,
                        local.device_id,
                    )
                )
                remote_rows.append(
                    _rows(
                        remote_base + theirs * np.uint64(remote.page_bytes) + np.uint64(piece.remote),
                        piece.length,
                        remote.device_id,
                    )
                )
    return np.concatenate(local_rows), np.concatenate(remote_rows)
