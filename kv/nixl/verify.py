"""Verified KV (`--kv-verify`): a checksum per handed-over block, checked after the READ.

The prefill worker checksums each block of a prompt it hands over, right after the forward
that filled it (every buffer's page of that block, in buffer order); the checksums travel
in `KVTransferParams.page_checksums`, and the decode worker recomputes them over the pages
the READ wrote. A mismatch (bytes corrupted on the way or in memory, or pages the prefill
side had already reused) makes the load a failed one, and the failure policy recomputes or
fails the request (docs/design.md §4, §12).

Tensor parallelism. Each prefill rank checksums what it holds, once per decode rank, over
exactly the bytes that decode rank READs of it (kv/nixl/tp_slices.py `read_pieces`: the whole
page between equal TP sizes, head slices otherwise), so each decode rank checks exactly
what it read, from each prefill rank it read from.

These are checksums against accidents, not a defence against an attacker: CRC-32 on CPU
memory (zlib, several GB/s without copying), and on a GPU a position-weighted 64-bit sum
computed on the device, so the pages never cross to the host. Both sides must use the same
one: the algorithm is part of the peers' compatibility record (kv/nixl/compat.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

Spans = Sequence[tuple[int, int]]  # (offset, length) byte ranges of a page


def algorithm(device: torch.device) -> str:
    return "crc32" if device.type == "cpu" else "wsum64"


def checksum_blocks(buffers: Sequence[torch.Tensor], block_ids: Sequence[int], spans: Spans | None = None) -> list[int]:
    """One checksum per block id, over the bytes `spans` (default: all) of that block's page
    in every `[num_blocks, page_bytes]` uint8 buffer, buffer by buffer, span by span. Under
    tensor parallelism the spans are what one decode rank READs of one prefill rank's page
    (kv/nixl/tp_slices.py `read_pieces`); no span checksums nothing, as 0."""
    if not block_ids:
        return []
    spans = [(0, buffers[0].shape[1])] if spans is None else list(spans)
    if not spans:
        return [0] * len(block_ids)
    if buffers[0].device.type == "cpu":
        pages = [buf.numpy() for buf in buffers]
        out = []
        for b in block_ids:
            crc = 0
            for page in pages:
                for offset, length in spans:
                    crc = zlib.crc32(page[b][offset : offset + length], crc)
            out.append(crc)
        return out
    return _weighted_sums(buffers, block_ids, spans)


def _weighted_sums(buffers: Sequence[torch.Tensor], block_ids: Sequence[int], spans: Spans | None = None) -> list[int]:
    device = buffers[0].device
    spans = [(0, buffers[0].shape[1])] if spans is None else spans
    if not spans:
        return [0] * len(block_ids)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    words = torch.cat([buf[index, offset : offset + length] for buf in buffers for offset, length in spans], dim=1)
    if words.shape[1] % 4 == 0:
        words = words.view(torch.int32)
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=device)
    # int64 arithmetic wraps: a changed word changes the sum unless weight * change is a
    # multiple of 2**64, which no single word's change can be; position weights make a page
    # moved to another buffer or offset change it too.
    return [int(x) for x in (words.to(torch.int64) * weights).sum(dim=1).tolist()]


def mismatched(
    buffers: Sequence[torch.Tensor], block_ids: Sequence[int], expected: Sequence[int], spans: Spans | None = None
) -> list[int]:
    """The blocks whose bytes (`spans` of their pages) do not match their expected checksums."""
    got = checksum_blocks(buffers, block_ids, spans)
    return [b for b, have, want in zip(block_ids, got, expected) if have != want]


def corrupt(buffers: Sequence[torch.Tensor], block_id: int) -> None:
    """Test fault: flip bits throughout one block's pages, as a bad link or memory would."""
    for buf in buffers:
        buf[block_id].bitwise_xor_(0x5A)


class HandOverChecksums:
    """A prefill rank's checksums of the blocks it hands over: `spans[d][g]` are the bytes of
    group g's pages that decode rank d READs (none: that rank reads nothing here)."""

    def __init__(self, buffers: Sequence[torch.Tensor], spans: Sequence[Sequence[Spans]]) -> None:
        self.buffers, self.spans = buffers, spans

    def table(self, block_ids: Sequence[Sequence[int]]) -> list[list[list[int]]]:
        """[decode rank][group][block] checksums of these blocks (one list per cache group)."""
        return [
            [checksum_blocks(self.buffers, ids, spans) for ids, spans in zip(block_ids, per_group)]
            for per_group in self.spans
        ]
