"""Attention over paged K/V: decode tokens and prefill chunks (fresh or after cached tokens) equal
attention over each request's own tokens, a NaN in an unused slot of a block the request owns
reaches the output (what makes zero-on-allocate necessary), and pages a request does not own
never do."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from kv.cache_group import CacheGroup
from models import attention
from models.attention import paged_attention
from models.batch import SeqChunk, build_forward_batch

BLOCK, KV_HEADS, HEADS, DIM, BLOCKS = 4, 2, 6, 8, 16
GROUPS = (CacheGroup("attention", (0,)),)


def _pages(dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views over head-major pages, as kv/cache_buffers.py lays them out."""
    torch.manual_seed(0)
    kv = torch.randn(BLOCKS, 2, KV_HEADS, BLOCK, dim)
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def _decode(computed: list[int], blocks: list[list[int]], k_cache: torch.Tensor, v_cache: torch.Tensor):
    chunks = [SeqChunk([1], n, [ids]) for n, ids in zip(computed, blocks)]
    batch = build_forward_batch(chunks, GROUPS, BLOCK, "cpu")
    q = torch.randn(len(chunks), HEADS, DIM)
    k, v = torch.randn(len(chunks), KV_HEADS, DIM), torch.randn(len(chunks), KV_HEADS, DIM)
    out = paged_attention(q, k, v, k_cache, v_cache, batch, batch.attn[0], DIM**-0.5)
    return q, out


def _own_tokens(cache: torch.Tensor, ids: list[int], length: int) -> torch.Tensor:
    """[KV_HEADS, length, DIM]: the request's tokens read block by block."""
    return torch.cat([cache[b] for b in ids])[:length].transpose(0, 1)


def test_decode_equals_attention_over_each_requests_own_tokens(decode_path):
    k_cache, v_cache = _pages()
    computed, blocks = [5, 1, 11], [[3, 7], [9], [2, 12, 4]]
    q, out = _decode(computed, blocks, k_cache, v_cache)
    for r, (n, ids) in enumerate(zip(computed, blocks)):
        keys, values = _own_tokens(k_cache, ids, n + 1), _own_tokens(v_cache, ids, n + 1)
        want = F.scaled_dot_product_attention(
            q[r][:, None], keys, values, scale=DIM**-0.5, enable_gqa=True
        )  # query head h reads KV head h // (HEADS // KV_HEADS)
        torch.testing.assert_close(out[r], want[:, 0], rtol=1e-5, atol=1e-5)


def test_a_nan_in_an_owned_unused_slot_reaches_the_output_and_other_pages_do_not(decode_path):
    k_cache, v_cache = _pages()
    v_cache[7, 3] = float("nan")  # request 0's second block, a slot past its position
    k_cache[0] = v_cache[0] = float("nan")  # nobody's page: request 1's table padding points at it
    _, out = _decode([5, 1], [[3, 7], [9]], k_cache, v_cache)
    assert out[0].isnan().all()
    assert math.isfinite(out[1].sum().item())


def _chunks(spans: list[tuple[int, int]], blocks: list[list[int]], k_cache: torch.Tensor, v_cache: torch.Tensor):
    """A step of one chunk per request, (tokens already cached, tokens now) each: the queries,
    the attention output (the new K/V written into the pages first) and the step's batch."""
    chunks = [SeqChunk([1] * n, done, [ids]) for (done, n), ids in zip(spans, blocks)]
    batch = build_forward_batch(chunks, GROUPS, BLOCK, "cpu")
    tokens, dim = sum(n for _, n in spans), k_cache.shape[-1]
    q = torch.randn(tokens, HEADS, dim)
    k, v = torch.randn(tokens, KV_HEADS, dim), torch.randn(tokens, KV_HEADS, dim)
    return q, paged_attention(q, k, v, k_cache, v_cache, batch, batch.attn[0], dim**-0.5), batch


@pytest.mark.parametrize(
    ("spans", "blocks"),
    [
        ([(0, 7)], [[3, 7]]),  # a fresh prompt alone: SDPA's own causal pattern
        ([(0, 7), (0, 3), (0, 10)], [[3, 7], [9], [2, 12, 4]]),  # fresh prompts of three lengths
        ([(0, 7), (5, 4)], [[3, 7], [9, 12, 1]]),  # one resumes after 5 cached tokens: the mask
        ([(6, 1), (0, 9)], [[3, 7], [9, 12, 1]]),  # a decode token beside a fresh prompt
        ([(6, 1), (2, 9)], [[3, 7], [9, 12, 1]]),  # ... beside a chunk with a cached start
    ],
)
def test_chunks_equal_causal_attention_over_each_requests_own_tokens(spans, blocks):
    """Query j of a chunk that starts after `done` cached tokens sees that request's tokens
    0..done + j, whether or not earlier chunks were cached: a prompt read as fresh when it is not
    would see only tokens 0..j."""
    k_cache, v_cache = _pages()
    q, out, _ = _chunks(spans, blocks, k_cache, v_cache)
    start = 0
    for (done, n), ids in zip(spans, blocks):
        keys, values = _own_tokens(k_cache, ids, done + n), _own_tokens(v_cache, ids, done + n)
        visible = torch.arange(done + n)[None, :] <= torch.arange(done, done + n)[:, None]
        want = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1), keys, values, attn_mask=visible, scale=DIM**-0.5, enable_gqa=True
        )
        torch.testing.assert_close(out[start : start + n], want.transpose(0, 1), rtol=1e-5, atol=1e-5)
        start += n


def test_fresh_prompts_take_the_causal_pattern_bit_for_bit():
    """A step of fresh prompts runs SDPA's causal pattern instead of a mask (`fresh`), and gets
    exactly the masked path's output: a prompt answers the same whether or not it was cached."""
    spans, blocks = [(0, 7), (0, 3), (0, 10)], [[3, 7], [9], [2, 12, 4]]
    k_cache, v_cache = _pages()
    torch.manual_seed(1)
    q, fresh, batch = _chunks(spans, blocks, k_cache, v_cache)
    meta = batch.attn[0]
    args = (q, k_cache, v_cache, meta.block_table, meta.padding, batch.positions, batch.token_req)
    rest = (batch.token_local, batch.max_query_len, DIM**-0.5)
    masked = attention._attend_chunks(*args, *rest, fresh=False)
    assert torch.equal(attention._attend_chunks(*args, *rest, fresh=True), masked)
    assert torch.equal(fresh, masked)


@pytest.mark.parametrize(
    ("spans", "blocks"),
    [
        ([(0, 7)], [[3, 7]]),  # a fresh prompt alone
        ([(0, 7), (0, 3), (0, 10)], [[3, 7], [9], [2, 12, 4]]),  # fresh prompts side by side
        ([(0, 7), (5, 4)], [[3, 7], [9, 12, 1]]),  # one resumes after 5 cached tokens
        ([(6, 1), (2, 9)], [[3, 7], [9, 12, 1]]),  # a decode token beside a resumed chunk
    ],
)
def test_with_wide_heads_every_chunk_takes_the_kernel(monkeypatch, spans, blocks):
    """Heads of 64: a step's chunks run `cpu_kernels.prefill_attention` in one call, fresh or
    after cached tokens, alone or not (a decode token beside them takes the decode kernel), and
    each equals attention over its request's own tokens; a NaN in the unused end of a chunk's
    last page still reaches its last token."""
    calls = []
    kernel = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *args: calls.append(1) or kernel(*args))
    with cpu_kernels.using(cpu_kernels.decide(True)):
        k_cache, v_cache = _pages(64)
        q, out, _ = _chunks(spans, blocks, k_cache, v_cache)
        assert calls == [1]
        start = 0
        for (done, n), ids in zip(spans, blocks):
            keys, values = _own_tokens(k_cache, ids, done + n), _own_tokens(v_cache, ids, done + n)
            visible = torch.arange(done + n)[None, :] <= torch.arange(done, done + n)[:, None]
            want = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1), keys, values, attn_mask=visible, scale=64**-0.5, enable_gqa=True
            )
            torch.testing.assert_close(out[start : start + n], want.transpose(0, 1), rtol=1e-5, atol=1e-5)
            start += n
        done, n = spans[-1]
        last = blocks[-1][(done + n - 1) // BLOCK]
        if (done + n) % BLOCK:
            v_cache[last, BLOCK - 1] = float("nan")  # the last chunk's last page, past its tokens
            _, out, _ = _chunks(spans, blocks, k_cache, v_cache)
            assert out[-1].isnan().any() and out[:-n].isfinite().all()
