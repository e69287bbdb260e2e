"""Head slices between tensor-parallel ranks: a reader's page assembled from the pieces it
reads of the remote ranks' pages is exactly its own page, every byte written once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv.nixl.tp_slices import PageSlicer, Piece, _parts, read_pieces
from kv.nixl.verify import _weighted_sums, checksum_blocks
from models.config import ModelConfig
from training.tiny_configs import nemotron_h, qwen3_5

BLOCK = 4


def _config(kind: str, **overrides) -> ModelConfig:
    d = {"nemotron_h": nemotron_h, "qwen3_5": qwen3_5}[kind]()
    d.update(overrides)
    return ModelConfig.from_hf_dict(d)


def _page(cfg: ModelConfig, kind: str, rank: int, size: int) -> np.ndarray:
    """A rank's page with every unit's bytes set to (part, global unit) so misplaced bytes show."""
    chunks = []
    for p, part in enumerate(_parts(cfg, kind, BLOCK, "bfloat16")):
        for unit in part.ranges(rank, size):
            chunks.append(np.full(part.unit_bytes, (p * 1009 + unit * 31 + 7) % 251, dtype=np.uint8))
    return np.concatenate(chunks)


CASES = [
    ("nemotron_h", {}),
    ("nemotron_h", {"num_key_value_heads": 1}),
    ("nemotron_h", {"n_groups": 2}),
    ("qwen3_5", {}),
    ("qwen3_5", {"num_key_value_heads": 1, "linear_num_key_heads": 1}),
]


@pytest.mark.parametrize("kind, overrides", CASES)
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_pieces_rebuild_the_readers_page(kind, overrides, prefill_tp, decode_tp):
    cfg = _config(kind, **overrides)
    for page_kind in ("attention", "mamba"):
        remote = [_page(cfg, page_kind, p, prefill_tp) for p in range(prefill_tp)]
        for d in range(decode_tp):
            slicer = PageSlicer(cfg, BLOCK, "bfloat16", d, decode_tp, ("attention", "mamba"))
            want = _page(cfg, page_kind, d, decode_tp)
            got = np.zeros_like(want)
            writes = np.zeros(len(want), dtype=np.int64)
            for p in range(prefill_tp):
                for piece in slicer.pieces(page_kind, p, prefill_tp):
                    got[piece.local : piece.local + piece.length] = remote[p][
                        piece.remote : piece.remote + piece.length
                    ]
                    writes[piece.local : piece.local + piece.length] += 1
            assert (writes == 1).all()
            assert (got == want).all()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (4, 2)])
def test_every_remote_rank_is_notified_by_its_readers(prefill_tp, decode_tp):
    cfg = _config("qwen3_5", num_key_value_heads=1, linear_num_key_heads=1)
    kinds = ("attention", "mamba")
    slicers = [PageSlicer(cfg, BLOCK, "bfloat16", d, decode_tp, kinds) for d in range(decode_tp)]
    for p in range(prefill_tp):
        notifiers = [s for s in slicers if s.notifies(p, prefill_tp)]
        assert len(notifiers) == slicers[0].readers(p, prefill_tp) >= 1


@pytest.mark.parametrize("checksum", [checksum_blocks, _weighted_sums])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (4, 2), (2, 2)])
def test_a_prefill_ranks_checksum_of_what_a_decode_rank_reads_matches_what_landed(checksum, prefill_tp, decode_tp):
    """--kv-verify per rank pair: prefill rank p's checksum of the spans decode rank d reads of
    its page equals d's checksum of where those bytes landed; a changed landed byte shows."""
    cfg = _config("nemotron_h", num_key_value_heads=1)
    kinds = ("attention", "mamba")
    for page_kind in kinds:
        remote = [_page(cfg, page_kind, p, prefill_tp) for p in range(prefill_tp)]
        for d in range(decode_tp):
            slicer = PageSlicer(cfg, BLOCK, "bfloat16", d, decode_tp, kinds)
            local = _page(cfg, page_kind, d, decode_tp)
            for p in range(prefill_tp):
                pieces = read_pieces(slicer, page_kind, p, prefill_tp, d, decode_tp, len(local))
                if prefill_tp == decode_tp:
                    assert pieces == (() if p != d else (Piece(0, 0, len(local)),))  # whole pages, rank to rank
                sent = checksum([torch.from_numpy(remote[p][None].copy())], [0], [(x.remote, x.length) for x in pieces])
                page = torch.from_numpy(local[None].copy())
                spans = [(x.local, x.length) for x in pieces]
                assert checksum([page], [0], spans) == sent
                if pieces:
                    page[0, pieces[-1].local] ^= 1
                    assert checksum([page], [0], spans) != sent
    with pytest.raises(ValueError, match="needs a slicer of size 2"):
        read_pieces(None, "attention", 0, 1, 0, 2, 64)
