"""Verified KV loads (`--kv-verify`) on the decode side (kv/nixl/worker.py): what the bytes each
READ writes must checksum to, and which blocks do not once the load has landed.

Each rank checks the spans it read from each prefill rank against that rank's checksums of
them (kv/nixl/tp_slices.py `read_pieces`: the whole page between equal TP sizes, head slices
otherwise), so a block whose bytes were corrupted on the way or in memory is reported failed
(kv/nixl/verify.py, docs/design.md §12).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv.nixl.load import Expected, Load
from kv.nixl.peers import PeerInfo
from kv.nixl.tp_slices import PageSlicer, read_pieces
from kv.nixl.transfer_params import Checksums
from kv.nixl.verify import mismatched


class LoadVerifier:
    """One rank's checks of its loads into `buffers`; `slicer` as the connector's."""

    def __init__(self, buffers: Sequence[torch.Tensor], page_bytes: int, slicer: PageSlicer | None) -> None:
        self._buffers = buffers
        self._page_bytes = page_bytes
        self._slicer = slicer
        self._rank, self._size = (slicer.rank, slicer.size) if slicer is not None else (0, 1)

    def expected(self, req_id: str, load: Load, remotes: Sequence[PeerInfo], sums: Checksums) -> Expected:
        """Per remote rank read from (`remotes`, as `load.targets`), the checksum its side took
        of the bytes this rank reads into each local block (`sums[remote rank][local
        rank][group][block]`)."""
        out: Expected = {}
        for info in remotes:
            if len(sums) != info.tp_size or len(sums[info.tp_rank]) != self._size:
                raise ValueError(
                    f"load {req_id}: checksums for {len(sums)} prefill x {len(sums[0]) if sums else 0} decode "
                    f"ranks, the peer has {info.tp_size} and this engine {self._size}"
                )
            mine = sums[info.tp_rank][self._rank]
            out[(info.tp_rank, info.tp_size)] = [
                (kind, local, mine[g][i])
                for g, (kind, group) in enumerate(zip(self._kinds(len(load.kept)), load.kept))
                for i, (local, _) in enumerate(group)
            ]
        return out

    def mismatched(self, load: Load) -> set[int]:
        """The blocks whose bytes read from some remote rank do not match that rank's checksum
        of them."""
        skipped, bad = set(load.skipped), set()
        for (rank, size), entries in load.expected.items():
            for kind in dict.fromkeys(k for k, _, _ in entries):
                blocks = [(b, s) for k, b, s in entries if k == kind and b not in skipped]
                pieces = read_pieces(self._slicer, kind, rank, size, self._rank, self._size, self._page_bytes)
                spans = [(p.local, p.length) for p in pieces]
                bad.update(mismatched(self._buffers, [b for b, _ in blocks], [s for _, s in blocks], spans))
        return bad

    def _kinds(self, num_groups: int) -> tuple[str, ...]:
        """Each cache group's kind; one slicer-less worker's whole pages need none."""
        return self._slicer.kinds if self._slicer is not None else ("",) * num_groups
