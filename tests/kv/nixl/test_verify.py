"""Checksums of KV blocks (kv/nixl/verify.py): both algorithms see a changed byte and a swap of
two pages; `page_checksums` travel in `KVTransferParams` only in the shape of its blocks."""

from __future__ import annotations

import pytest
import torch

from kv.nixl.verify import _weighted_sums, checksum_blocks, corrupt, mismatched


def buffers(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (6, 256), dtype=torch.uint8, generator=g) for _ in range(3)]


@pytest.mark.parametrize("checksum", [checksum_blocks, _weighted_sums])
def test_a_changed_byte_or_swapped_pages_change_the_checksum(checksum):
    bufs = buffers()
    before = checksum(bufs, [0, 1, 2, 3])
    assert before == checksum([b.clone() for b in bufs], [0, 1, 2, 3]) and len(set(before)) == 4
    bufs[2][1, 77] ^= 1  # one bit of one page of block 1
    assert checksum(bufs, [0, 1, 2, 3]) == [before[0], checksum(bufs, [1])[0], before[2], before[3]]
    assert checksum(bufs, [1]) != [before[1]]
    swapped = buffers()
    swapped[0][3], swapped[1][3] = swapped[1][3].clone(), swapped[0][3].clone()  # block 3's pages swap buffers
    assert checksum(swapped, [3]) != [before[3]]


def test_mismatched_names_the_corrupted_block():
    bufs = buffers(1)
    want = checksum_blocks(bufs, [4, 5])
    corrupt(bufs, 5)
    assert mismatched(bufs, [4, 5], want) == [5]


def test_spans_checksum_only_their_bytes():
    bufs = buffers(2)
    spans = [(0, 4), (8, 4)]
    before = checksum_blocks(bufs, [1], spans)
    bufs[1][1, 5] ^= 1  # outside the spans
    assert checksum_blocks(bufs, [1], spans) == before and checksum_blocks(bufs, [1], []) == [0]
    bufs[1][1, 9] ^= 1  # inside
    assert mismatched(bufs, [1], before, spans) == [1]
    assert _weighted_sums(bufs, [1], spans) != _weighted_sums(bufs, [1], [(8, 4), (0, 4)])
