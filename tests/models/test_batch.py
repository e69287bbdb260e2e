"""`build_forward_batch` against a per-request, per-token construction of the same metadata:
mixed steps of decode tokens, first chunks and later chunks, blocks owned beyond what a step
reads, and the errors a malformed step gets."""

from __future__ import annotations

import random

import pytest
import torch

from kv.cache_group import CacheGroup, cdiv
from models.batch import SeqChunk, build_forward_batch

GROUPS = (CacheGroup("attention", (1, 3)), CacheGroup("mamba", (0, 2)))
BLOCK = 4


def _chunks(rng: random.Random, num_reqs: int) -> list[SeqChunk]:
    chunks = []
    for r in range(num_reqs):
        computed = rng.choice([0, rng.randrange(1, 40)])
        n = rng.choice([1, 1, rng.randrange(1, 12)])
        owned = cdiv(computed + n, BLOCK) + rng.randrange(0, 3)  # look-ahead blocks are not read
        attn = rng.sample(range(1000), owned)
        chunks.append(SeqChunk([rng.randrange(50) for _ in range(n)], computed, (attn, [2000 + r])))
    return chunks


def _expected(chunks: list[SeqChunk]) -> dict[str, object]:
    pos, req, local, table, valid, slots = [], [], [], [], [], []
    used = [cdiv(c.num_computed + len(c.token_ids), BLOCK) for c in chunks]
    for r, c in enumerate(chunks):
        for i in range(len(c.token_ids)):
            p = c.num_computed + i
            pos.append(p)
            req.append(r)
            local.append(i)
            slots.append(c.block_ids[0][p // BLOCK] * BLOCK + p % BLOCK)
        table.append(list(c.block_ids[0][: used[r]]) + [0] * (max(used) - used[r]))
        valid.append([True] * used[r] + [False] * (max(used) - used[r]))
    decode = [r for r, c in enumerate(chunks) if len(c.token_ids) == 1 and c.num_computed > 0]
    return {
        "positions": pos,
        "token_req": req,
        "token_local": local,
        "table": table,
        "valid": valid,
        "slots": slots,
        "decode": tuple(decode),
        "chunks": tuple(r for r in range(len(chunks)) if r not in decode),
    }


@pytest.mark.parametrize("seed", range(20))
def test_matches_per_token_construction(seed):
    rng = random.Random(seed)
    chunks = _chunks(rng, rng.choice([1, 3, 17, 64]))
    if seed % 4 == 0:  # a pure decode step takes its own path
        chunks = [SeqChunk([c.token_ids[0]], max(c.num_computed, 1), c.block_ids) for c in chunks]
    batch = build_forward_batch(chunks, GROUPS, BLOCK, "cpu")
    want = _expected(chunks)
    assert batch.input_ids.tolist() == [t for c in chunks for t in c.token_ids]
    assert batch.positions.tolist() == want["positions"]
    assert batch.token_req.tolist() == want["token_req"]
    assert batch.token_local.tolist() == want["token_local"]
    meta = batch.attn[1]
    assert meta is batch.attn[3]
    assert meta.block_table.tolist() == want["table"]
    assert meta.block_valid.tolist() == want["valid"]
    assert meta.slot_mapping.tolist() == want["slots"]
    assert batch.mamba_slots[0].tolist() == [2000 + r for r in range(len(chunks))]
    assert (batch.decode_reqs, batch.chunk_reqs) == (want["decode"], want["chunks"])
    assert batch.logits_indices.tolist() == [s - 1 for s in batch.query_start[1:]]
    assert batch.max_query_len == max(len(c.token_ids) for c in chunks)


def test_malformed_steps_are_refused():
    with pytest.raises(ValueError, match="at least one request"):
        build_forward_batch([], GROUPS, BLOCK, "cpu")
    ok = SeqChunk([1], 3, ([0], [9]))
    with pytest.raises(ValueError, match="request 1 schedules no tokens"):
        build_forward_batch([ok, SeqChunk([], 3, ([0], [9]))], GROUPS, BLOCK, "cpu")
    with pytest.raises(ValueError, match="request 0 has 1 blocks, needs 2"):
        build_forward_batch([SeqChunk([1, 2], 3, ([0], [9]))], GROUPS, BLOCK, "cpu")
    assert build_forward_batch([ok], GROUPS, BLOCK, torch.device("cpu")).decode_reqs == (0,)
