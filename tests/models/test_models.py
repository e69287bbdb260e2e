"""Our models against transformers, and the flat mixed batch against requests run alone."""

from __future__ import annotations

import pytest
import torch

from kv.cache_buffers import allocate_caches
from kv.cache_group import cdiv
from kv.cache_layout import plan_layout
from models.batch import SeqChunk, build_forward_batch
from models.loader import load_model
from models.reference import greedy_generate

torch.manual_seed(0)
PROMPTS = [torch.randint(2, 90, (n,)).tolist() for n in (37, 5, 64, 18)]


def _fixed_blocks(layout, num_reqs: int, per_req: int) -> list[list[list[int]]]:
    """Give each request `per_req` blocks in every attention group and one state slot."""
    blocks, next_id = [], 0
    for _ in range(num_reqs):
        ids = []
        for g in layout.groups:
            n = per_req if g.kind == "attention" else 1
            ids.append(list(range(next_id, next_id + n)))
            next_id += n
        blocks.append(ids)
    return blocks


@pytest.fixture(scope="module")
def loaded(hf_model):
    kind, path, ref = hf_model
    return kind, load_model(path, dtype=torch.float32), ref


def test_dense_logits_match_transformers(loaded):
    _, ours, ref = loaded
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        diff = (ours.model.forward_dense(ids) - ref(ids).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_prefill_logits_match_transformers(loaded, decode_path, block_size):
    _, ours, ref = loaded
    cfg = ours.config
    layout = plan_layout(cfg, "float32", block_size, num_blocks=200)
    buffers, caches = allocate_caches(layout, cfg, "cpu")
    for buf in buffers:
        buf.zero_()
    blocks = _fixed_blocks(layout, len(PROMPTS), cdiv(64, block_size))
    chunks = [SeqChunk(p, 0, ids) for p, ids in zip(PROMPTS, blocks)]
    with torch.no_grad():
        got = ours.model(build_forward_batch(chunks, layout.groups, block_size, "cpu"), caches)
        want = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    assert (got - want).abs().max().item() < 1e-4


def test_greedy_continuations_match_transformers_generate(loaded, decode_path):
    _, ours, ref = loaded
    for p in PROMPTS[:3]:
        got = greedy_generate(ours.model, [p], 32, eos_token_id=None, block_size=4)[0]
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert got == want[0, len(p) :].tolist()


@pytest.mark.parametrize("block_size", [4, 16])
def test_flat_batch_equals_each_alone(loaded, decode_path, block_size):
    _, ours, _ = loaded
    alone = [greedy_generate(ours.model, [p], 24, None, block_size=block_size)[0] for p in PROMPTS]
    together = greedy_generate(ours.model, PROMPTS, 24, None, block_size=block_size)
    assert together == alone


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(loaded, decode_path, chunk):
    _, ours, _ = loaded
    one_shot = greedy_generate(ours.model, PROMPTS, 16, None, block_size=4)
    assert greedy_generate(ours.model, PROMPTS, 16, None, block_size=4, prefill_chunk=chunk) == one_shot


def test_mixed_prefill_and_decode_in_one_call(loaded, decode_path):
    """Requests start one step apart, so every call mixes prefill chunks with decode tokens."""
    _, ours, _ = loaded
    block_size, chunk, new = 4, 9, 12
    cfg = ours.config
    layout = plan_layout(cfg, "float32", block_size, num_blocks=200)
    buffers, caches = allocate_caches(layout, cfg, "cpu")
    blocks = _fixed_blocks(layout, len(PROMPTS), cdiv(max(map(len, PROMPTS)) + new, block_size))
    for buf in buffers:
        buf.zero_()
    tokens = [list(p) for p in PROMPTS]
    computed = [0] * len(PROMPTS)
    step = 0
    mixed_steps = 0
    while any(len(t) - len(p) < new for t, p in zip(tokens, PROMPTS)):
        live = [r for r in range(len(PROMPTS)) if r <= step and len(tokens[r]) - len(PROMPTS[r]) < new]
        chunks = [SeqChunk(tokens[r][computed[r] : computed[r] + chunk], computed[r], blocks[r]) for r in live]
        mixed_steps += len({len(c.token_ids) == 1 for c in chunks}) == 2
        with torch.no_grad():
            logits = ours.model(build_forward_batch(chunks, layout.groups, block_size, "cpu"), caches)
        for r, c, row in zip(live, chunks, logits):
            computed[r] += len(c.token_ids)
            if computed[r] == len(tokens[r]):
                tokens[r].append(int(row.argmax()))
        step += 1
    assert mixed_steps >= 2
    alone = [greedy_generate(ours.model, [p], new, None, block_size=block_size)[0] for p in PROMPTS]
    assert [t[len(p) :] for t, p in zip(tokens, PROMPTS)] == alone
