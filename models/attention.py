"""Attention over paged K/V, and the dense causal attention used in training.

The paged path gathers *whole* blocks through each request's block table and masks the
slots past the query position with a zero probability. Probabilities multiply the values,
so a NaN left in an unused slot of an allocated block still turns the output into NaN
(0 * NaN = NaN). That is deliberate: it is the property that makes zero-on-allocate
necessary (docs/design.md §1), and the tests rely on it to see the bug when zeroing is skipped.
Slots of table padding (blocks the request does not own) are replaced by zeros, so one
request never poisons another. On a CPU, decode steps and prompt chunks read the pages in place
through C++ kernels that keep both properties (docs/design.md §13).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from models.batch import AttnMeta, ForwardBatch, padding_indices, visible_slots


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
    """q: [N, H, D]; k, v: [N, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [N, H, D].

    Single-token (decode) requests are attended together and multi-token chunks together:
    queries are padded to the longest chunk of their own kind, so a prefill chunk in the
    step does not make every decode request carry hundreds of padded query rows. Where the
    C++ kernels take the chunks (`_kernel_takes`), they go in one `cpu_kernels.prefill_attention`
    call, read from their pages where they lie, fresh or after cached tokens, alone or not
    (docs/design.md §13): no padding, and no key tile computed to be masked out. Its output
    equals SDPA's to rounding, and a chunk's rows are the same however its prompt was cut."""
    blocks, offsets = meta.write_blocks, meta.write_offsets
    if uses_cpu_kernel(k, k_cache):
        cpu_kernels.write_kv(k_cache, v_cache, k, v, blocks, offsets)
    else:
        k_cache[blocks, offsets] = _as(k, k_cache.dtype)
        v_cache[blocks, offsets] = _as(v, v_cache.dtype)
    if batch.max_query_len == 1:
        return _attend_decode(
            q, k_cache, v_cache, meta.block_table, meta.padding, batch.positions, meta.decode_mask, scale
        )
    lens = batch.query_lens
    single = [r for r, n in enumerate(lens) if n == 1]
    multi = [r for r, n in enumerate(lens) if n > 1]
    on_kernel = _kernel_takes(q, k_cache)
    if not single and not on_kernel:
        return _attend_chunks(
            q,
            k_cache,
            v_cache,
            meta.block_table,
            meta.padding,
            batch.positions,
            batch.token_req,
            batch.token_local,
            batch.max_query_len,
            scale,
            fresh=not any(batch.num_computed),
        )
    out = q.new_empty(q.shape)
    device = q.device
    if single:
        rows = torch.tensor([batch.query_start[r] for r in single], dtype=torch.long, device=device)
        reqs = torch.tensor(single, dtype=torch.long, device=device)
        out[rows] = _attend_decode(
            q[rows],
            k_cache,
            v_cache,
            meta.block_table[reqs],
            _padding(meta, reqs),
            batch.positions[rows],
            None,
            scale,
        )
    reqs = torch.tensor(multi, dtype=torch.long, device=device)
    if on_kernel:
        # Every chunk in one call, its rows written where they lie (docs/design.md §13).
        table = meta.block_table[reqs] if single else meta.block_table
        chunks = torch.tensor([(batch.query_start[r], lens[r], batch.num_computed[r]) for r in multi], dtype=torch.long)
        cpu_kernels.prefill_attention(
            q, k_cache, v_cache, table, chunks, out, scale, cpu_kernels.installed().vector_bits
        )
        return out
    rows = torch.tensor(
        [t for r in multi for t in range(batch.query_start[r], batch.query_start[r + 1])],
        dtype=torch.long,
        device=device,
    )
    token_req = torch.tensor([i for i, r in enumerate(multi) for _ in range(lens[r])], dtype=torch.long, device=device)
    out[rows] = _attend_chunks(
        q[rows],
        k_cache,
        v_cache,
        meta.block_table[reqs],
        _padding(meta, reqs),
        batch.positions[rows],
        token_req,
        batch.token_local[rows],
        max(lens),
        scale,
        fresh=not any(batch.num_computed[r] for r in multi),
    )
    return out


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without the call where the dtypes agree: a decode step made four such
    calls in every attention layer, each a dispatch that returned its input."""
    return x if x.dtype == dtype else x.to(dtype)


def uses_cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernels write and read the pages: on a CPU, with the cache in the
    queries' dtype (a cache of another dtype is converted on the torch path)."""
    return q.dtype == k_cache.dtype and cpu_kernels.usable(q, k_cache)


def _padding(meta: AttnMeta, reqs: torch.Tensor) -> torch.Tensor | None:
    """The padding of the table's rows `reqs` (a step's decode rows or its chunk rows)."""
    return None if meta.padding is None else padding_indices(meta.block_valid[reqs])


def _gather(cache: torch.Tensor, table: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """[R, W] block table -> [R, W * block_size, KVH, D]. `index_select` copies whole pages
    (advanced indexing on the strided page views is several times slower); the table's
    padding entries (`padding`, flat indices into it) are then zeroed in place, by page index
    (a boolean-mask assignment cost more than the gather itself)."""
    reqs, width = table.shape
    _, block_size, kv_heads, head_dim = cache.shape
    out = cache.index_select(0, table.flatten())
    if padding is not None:
        out.index_fill_(0, padding, 0)
    return out.view(reqs, width * block_size, kv_heads, head_dim)


def _attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    padding: torch.Tensor | None,
    positions: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query per request. q: [R, H, D]; positions: [R]; visible: [R, 1, 1, S]
    (`visible_slots`), or None to build it here. Returns [R, H, D].

    On a CPU the C++ kernel reads the pages where they lie (docs/design.md §13); it needs
    neither the table's padding nor the mask, as it stops at each request's position."""
    if uses_cpu_kernel(q, k_cache):
        return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, positions, scale)
    if visible is None:
        visible = visible_slots(table.shape[1] * k_cache.shape[1], positions)
    reqs, heads, head_dim = q.shape
    keys = _as(_gather(k_cache, table, padding), q.dtype).transpose(1, 2)  # [R, KVH, S, D], a view
    values = _as(_gather(v_cache, table, padding), q.dtype).transpose(1, 2)
    # SDPA reads the strided views as they are; a boolean mask keeps the masked slots'
    # values in the product (0 * NaN = NaN), as the chunk path does.
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.view(reqs, heads, head_dim)


def _kernel_takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `cpu_kernels.prefill_attention` takes a step's chunks: fp32 queries and pages on
    a CPU with the kernels on, heads of a multiple of 64, each token's heads contiguous."""
    head_dim = q.shape[-1]
    return (
        head_dim % 64 == 0
        and q.dtype == k_cache.dtype == torch.float32
        and q.stride(-1) == 1
        and q.stride(1) == head_dim
        and cpu_kernels.usable(q, k_cache)
    )


def _attend_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    padding: torch.Tensor | None,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    token_local: torch.Tensor,
    max_query_len: int,
    scale: float,
    fresh: bool = False,
) -> torch.Tensor:
    """Chunks of several queries, padded to the longest. q: [N, H, D]. Returns [N, H, D].

    SDPA with a boolean causal mask, as on decode steps: masked slots get probability 0 and
    their values still enter the product. It tiles the product instead of building the
    [R, H, Q, S] scores and probabilities (two einsums, a mask and a softmax were 4x slower on
    a prefill of 16 prompts).

    `fresh`: every chunk starts at position 0 (nothing of its request was cached before), so
    query i sees keys 0..i, which is SDPA's own causal pattern (`is_causal`, aligned to the top
    left): no mask is built, and SDPA skips the key tiles past each query tile instead of
    computing them and masking them out. On a CPU the output is bit for bit the masked one,
    and a 1024-token dense prompt's first token comes ~11% sooner (docs/design.md §13). Where
    the C++ kernels run, fp32 with heads of a multiple of 64, `paged_attention` sends the
    chunks to the kernel instead."""
    heads, head_dim = q.shape[1:]
    reqs = table.shape[0]
    keys = _gather(k_cache, table, padding)
    values = _gather(v_cache, table, padding)
    # One chunk (a prompt's prefill on its own): its queries, in order, are the padded batch
    # already; padding them was four copies and index writes of [N, H, D] per layer.
    alone = reqs == 1 and q.shape[0] == max_query_len
    if alone:
        qp = q[None]
    else:
        qp = q.new_zeros((reqs, max_query_len, heads, head_dim))
        qp[token_req, token_local] = q
    mask = None
    if not fresh:
        if alone:
            qpos = positions[None]
        else:
            qpos = torch.zeros((reqs, max_query_len), dtype=torch.long, device=q.device)
            qpos[token_req, token_local] = positions
        mask = (torch.arange(keys.shape[1], device=q.device)[None, None, :] <= qpos[:, :, None])[:, None]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        _as(keys, q.dtype).transpose(1, 2),
        _as(values, q.dtype).transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        is_causal=fresh,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[0] if alone else out.transpose(1, 2)[token_req, token_local]


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, T, H, D]; k, v: [B, T, KVH, D]. Returns [B, T, H, D]."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2)
