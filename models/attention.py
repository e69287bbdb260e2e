"""Attention over paged K/V, and the dense causal attention used in training.

The paged path gathers *whole* blocks through each request's block table and masks the
slots past the query position with a zero probability. Probabilities multiply the values,
so a NaN left in an unused slot of an allocated block still turns the output into NaN
(0 * NaN = NaN). That is deliberate: it is the property that makes zero-on-allocate
necessary (docs/design.md §1), and the tests rely on it to see the bug when zeroing is skipped.
Slots of table padding (blocks the request does not own) are replaced by zeros, so one
request never poisons another.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from models.batch import AttnMeta, ForwardBatch


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    meta: AttnMeta,
    scale: float,
) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [N, H, D]."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)

    reqs, width = meta.block_table.shape
    valid = meta.block_valid[:, :, None, None, None]
    keys = k_cache[meta.block_table].where(valid, 0).reshape(reqs, width * block_size, kv_heads, head_dim)
    values = v_cache[meta.block_table].where(valid, 0).reshape(reqs, width * block_size, kv_heads, head_dim)

    heads = q.shape[1]
    group = heads // kv_heads
    qp = q.new_zeros((reqs, batch.max_query_len, heads, head_dim))
    qp[batch.token_req, batch.token_local] = q
    qpos = torch.zeros((reqs, batch.max_query_len), dtype=torch.long, device=q.device)
    qpos[batch.token_req, batch.token_local] = batch.positions
    qp = qp.view(reqs, batch.max_query_len, kv_heads, group, head_dim)

    scores = torch.einsum("rqkgd,rskd->rkgqs", qp, keys.to(q.dtype)).float() * scale
    kpos = torch.arange(width * block_size, device=q.device)
    causal = kpos[None, None, :] <= qpos[:, :, None]  # [R, Q, S]
    scores = scores.masked_fill(~causal[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.einsum("rkgqs,rskd->rqkgd", probs, values.to(q.dtype))
    return out.reshape(reqs, batch.max_query_len, heads, head_dim)[batch.token_req, batch.token_local]


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, T, H, D]; k, v: [B, T, KVH, D]. Returns [B, T, H, D]."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2)
