"""Which bytes of a remote tensor-parallel rank's pages a local rank reads (PD with TP).

A rank's page holds its share of the heads (models/tensor_parallel.py), laid out as parts
whose bytes are each contiguous per head (docs/design.md §11):

- attention: K then V, each `[kv_heads, block_size, head_dim]` (head-major, so one head's
  tokens are one run of bytes);
- Mamba2 state: the conv window's x, B and C channels, then the SSM state by head;
- Gated DeltaNet state: the conv window's q, k and v channels, then the state by value head.

A part is a range of global units (a head, a channel) per rank. Between engines of different
TP sizes a local rank reads, from each remote rank, the units it needs that the remote rank
holds, as one `Piece` per part. A unit several remote ranks hold (replicated KV heads, a
single Mamba group) is read once, from the lowest of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from models.config import ModelConfig
from models.dtypes import DTYPE_BYTES
from models.tp_shards import split_heads

Ranges = Callable[[int, int], range]  # (rank, size) -> the global units that rank holds


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [remote, remote + length) of a remote page land at [local, local + length)."""

    local: int
    remote: int
    length: int


@dataclass(frozen=True, slots=True)
class _Part:
    unit_bytes: int
    ranges: Ranges


def _even(n: int) -> Ranges:
    return lambda rank, size: range(rank * n // size, (rank + 1) * n // size)


def _scaled(ranges: Ranges, width: int) -> Ranges:
    def scaled(rank: int, size: int) -> range:
        r = ranges(rank, size)
        return range(r.start * width, r.stop * width)

    return scaled


def _parts(cfg: ModelConfig, kind: str, block_size: int, attn_dtype: str) -> tuple[_Part, ...]:
    if kind == "attention":
        heads = _Part(
            block_size * cfg.head_dim * DTYPE_BYTES[attn_dtype],
            lambda rank, size: split_heads(cfg.num_attention_heads, cfg.num_key_value_heads, rank, size, "").kv,
        )
        return heads, heads
    if cfg.mamba is not None:
        m = cfg.mamba
        window = 4 * (m.conv_kernel - 1)
        groups = _even(m.n_groups) if m.n_groups > 1 else (lambda rank, size: range(1))
        x = _Part(window, _scaled(_even(m.num_heads), m.head_dim))
        bc = _Part(window, _scaled(groups, m.state_size))
        return x, bc, bc, _Part(4 * m.head_dim * m.state_size, _even(m.num_heads))
    g = cfg.gated_delta_net
    assert g is not None
    window = 4 * (g.conv_kernel - 1)

    def split(rank: int, size: int) -> tuple[range, range]:
        s = split_heads(g.num_v_heads, g.num_k_heads, rank, size, "")
        return s.q, s.kv

    keys = _Part(window, _scaled(lambda rank, size: split(rank, size)[1], g.head_k_dim))
    values = _Part(window, _scaled(lambda rank, size: split(rank, size)[0], g.head_v_dim))
    return keys, keys, values, _Part(4 * g.head_k_dim * g.head_v_dim, lambda rank, size: split(rank, size)[0])


class PageSlicer:
    """Rank `rank` of `size`'s view of the pages of a model (`cfg` is the full model's)."""

    def __init__(
        self, cfg: ModelConfig, block_size: int, attn_dtype: str, rank: int, size: int, kinds: tuple[str, ...]
    ) -> None:
        self.cfg, self.block_size, self.attn_dtype = cfg, block_size, attn_dtype
        self.rank, self.size, self.kinds = rank, size, kinds

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a few remote layouts per connector, which lives as long)
    def pieces(self, kind: str, remote_rank: int, remote_size: int, rank: int | None = None) -> tuple[Piece, ...]:
        """What (local) `rank` (default: this one) reads from `remote_rank`'s pages of `kind`."""
        me = self.rank if rank is None else rank
        out: list[Piece] = []
        local = remote = 0
        for part in _parts(self.cfg, kind, self.block_size, self.attn_dtype):
            mine = part.ranges(me, self.size)
            theirs = part.ranges(remote_rank, remote_size)
            below = part.ranges(remote_rank - 1, remote_size).stop if remote_rank > 0 else 0
            lo, hi = max(mine.start, theirs.start, below), min(mine.stop, theirs.stop)
            if lo < hi:
                unit = part.unit_bytes
                out.append(
                    Piece(local + (lo - mine.start) * unit, remote + (lo - theirs.start) * unit, (hi - lo) * unit)
                )
            local += len(mine) * part.unit_bytes
            remote += len(theirs) * part.unit_bytes
        return tuple(out)

    def reads_from(self, remote_rank: int, remote_size: int, rank: int | None = None) -> bool:
        return any(self.pieces(kind, remote_rank, remote_size, rank) for kind in self.kinds)

    def readers(self, remote_rank: int, remote_size: int) -> int:
        """How many local ranks notify `remote_rank` per request: those that read from it, or
        one (rank `remote_rank % size`) when none does, so its blocks are still freed."""
        return max(1, sum(self.reads_from(remote_rank, remote_size, r) for r in range(self.size)))

    def notifies(self, remote_rank: int, remote_size: int) -> bool:
        """Whether this rank is one of `remote_rank`'s notifiers."""
        if self.reads_from(remote_rank, remote_size):
            return True
        nobody = not any(self.reads_from(remote_rank, remote_size, r) for r in range(self.size))
        return nobody and remote_rank % self.size == self.rank


def read_pieces(
    slicer: PageSlicer | None, kind: str, remote_rank: int, remote_size: int, rank: int, size: int, page_bytes: int
) -> tuple[Piece, ...]:
    """What rank `rank` of `size` READs from `remote_rank` of `remote_size`'s pages of `kind`
    (kv/nixl/worker.py): between equal TP sizes the whole page of the same rank, otherwise its
    head slices, as `slicer` (one of size `size`) cuts them. --kv-verify checksums exactly
    these bytes on both sides."""
    if remote_size == size:
        return (Piece(0, 0, page_bytes),) if remote_rank == rank else ()
    if slicer is None or slicer.size != size:
        raise ValueError(f"reading a TP {remote_size} peer's pages from TP {size} needs a slicer of size {size}")
    return slicer.pieces(kind, remote_rank, remote_size, rank)
