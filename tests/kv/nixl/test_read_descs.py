"""The descriptors a NIXL READ moves (kv/nixl/read_descs.py): each prepared page is one
(buffer, block) row, a load's index lists pick exactly its block pairs' pages, and head
slices land at their pieces' offsets of the right pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv.cache_buffers import buffer_pages
from kv.nixl.read_descs import Pages, page_indices, reads_any, slice_descs
from kv.nixl.tp_slices import Piece

LOCAL = Pages(base_addrs=(1 << 20, 3 << 20), page_bytes=64, num_blocks=3, device_id=0)
REMOTE = Pages(base_addrs=(7 << 20, 9 << 20), page_bytes=32, num_blocks=5, device_id=1)


def test_page_rows_are_buffer_by_buffer():
    rows = LOCAL.descs()
    assert rows.dtype == np.uint64 and rows.shape == (6, 3)
    for buf, base in enumerate(LOCAL.base_addrs):
        for block in range(LOCAL.num_blocks):
            assert tuple(rows[buf * LOCAL.num_blocks + block]) == (base + block * 64, 64, 0)


def test_page_indices_pick_every_buffers_page_of_each_pair():
    pairs = [[(0, 4), (2, 1)], [(1, 0)]]
    local_idx, remote_idx = page_indices(LOCAL, REMOTE, pairs)
    assert local_idx.dtype == np.int32 and len(local_idx) == len(remote_idx) == 2 * 3
    local_rows, remote_rows = LOCAL.descs()[local_idx], REMOTE.descs()[remote_idx]
    flat = [pair for group in pairs for pair in group]
    for buf in range(2):
        for j, (a, b) in enumerate(flat):
            k = buf * len(flat) + j
            assert local_rows[k, 0] == LOCAL.base_addrs[buf] + a * LOCAL.page_bytes
            assert remote_rows[k, 0] == REMOTE.base_addrs[buf] + b * REMOTE.page_bytes


def test_head_slices_land_at_their_pieces_of_the_right_pages():
    pieces = [(Piece(local=0, remote=8, length=4), Piece(local=16, remote=20, length=6)), ()]
    pairs = [[(1, 2), (2, 4)], [(0, 0)]]  # the second group has nothing to read here
    local, remote = slice_descs(LOCAL, REMOTE, pieces, pairs)
    want_local, want_remote = [], []
    for buf in range(2):
        for piece in pieces[0]:
            for a, b in pairs[0]:
                want_local.append((LOCAL.base_addrs[buf] + a * 64 + piece.local, piece.length, 0))
                want_remote.append((REMOTE.base_addrs[buf] + b * 32 + piece.remote, piece.length, 1))
    # Row i of the local list lands what row i of the remote one holds.
    assert [tuple(row) for row in local.tolist()] == want_local
    assert [tuple(row) for row in remote.tolist()] == want_remote


@pytest.mark.parametrize(
    ("pairs", "pieces", "reads"),
    [
        ([[(0, 0)]], None, True),
        ([[], []], None, False),
        ([[(0, 0)], []], [(), (Piece(0, 0, 4),)], False),  # slices only where no block is read
        ([[(0, 0)], []], [(Piece(0, 0, 4),), ()], True),
    ],
)
def test_a_read_moves_anything_only_with_blocks_and_slices(pairs, pieces, reads):
    assert reads_any(pairs, pieces) is reads


def test_buffers_are_validated():
    with pytest.raises(ValueError, match="at least one buffer"):
        buffer_pages([], 64, 4)
    with pytest.raises(ValueError, match=r"buffer 1 must be a contiguous uint8 \[4, 64\]"):
        buffer_pages([torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8)], 64, 4)
    with pytest.raises(ValueError, match="contiguous"):
        buffer_pages([torch.zeros(64, 4, dtype=torch.uint8).t()], 64, 4)
    with pytest.raises(ValueError, match="CPU or CUDA memory, not meta"):
        buffer_pages([torch.zeros(4, 64, dtype=torch.uint8, device="meta")], 64, 4)
    buffers = [torch.zeros(4, 64, dtype=torch.uint8) for _ in range(2)]
    assert buffer_pages(buffers, 64, 4) == Pages(tuple(b.data_ptr() for b in buffers), 64, 4, 0)
