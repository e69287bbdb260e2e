"""The flat mixed batch one forward call runs.

A step mixes prefill chunks of any length with single decode tokens. Tokens are laid out
flat (request after request); per-request metadata says where each request's tokens start,
how many tokens it already has in the cache, which attention blocks hold its K/V and which
Mamba state slot holds its recurrent state. The worker builds this from the scheduler's
step output; the model only reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from kernels.cpu import ops as cpu_kernels
from kv.cache_group import CacheGroup, cdiv

LayerCache = tuple[torch.Tensor, torch.Tensor]
"""Attention: (K, V), each [num_blocks, block_size, kv_heads, head_dim] in the cache dtype.
Mamba: (conv state [num_blocks, conv_dim, kernel - 1], SSM state [num_blocks, heads, head_dim,
state]), fp32. Both are views over page memory owned by `kv/`."""


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a step: the tokens to compute now and where its cache lives."""

    token_ids: Sequence[int]
    num_computed: int
    block_ids: Sequence[Sequence[int]]  # one list per cache group, in group order


@dataclass(frozen=True, slots=True)
class AttnMeta:
    """Shared by every attention layer of a cache group in the step: what the layers would
    otherwise each derive again (the write positions, the table's padding) is derived here once."""

    block_table: torch.Tensor  # [R, max_blocks] page indices, padded with 0
    block_valid: torch.Tensor  # [R, max_blocks] False where the table is padding
    slot_mapping: torch.Tensor  # [N] flat slot each new token's K/V is written to
    write_blocks: torch.Tensor  # [N] slot_mapping // block_size: the page each new K/V goes to
    write_offsets: torch.Tensor  # [N] slot_mapping % block_size: its slot in that page
    padding: torch.Tensor | None  # flat indices into block_table of its padding; None: no padding
    # On a step of single-token requests, [R, 1, 1, max_blocks * block_size]: the slots each
    # request's query may see (built once here, not by every layer); None on other steps and
    # where the C++ decode kernel runs (it stops at each request's position).
    decode_mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    token_req: torch.Tensor  # [N] request index of each token
    token_local: torch.Tensor  # [N] index of the token within its request's chunk
    query_start: tuple[int, ...]  # R + 1 offsets into the flat tokens
    num_computed: tuple[int, ...]  # per request, tokens already cached before this step
    max_query_len: int
    logits_indices: torch.Tensor  # [R] flat index of each request's last token
    block_size: int
    attn: dict[int, AttnMeta]  # by layer id
    mamba_slots: dict[int, torch.Tensor]  # by layer id: [R] state slot per request
    # Requests advancing by one token on top of existing state (run as one vector step), and
    # the others (prefill chunks, run one by one): found once here, read by every state layer.
    decode_reqs: tuple[int, ...]
    chunk_reqs: tuple[int, ...]
    # The state kernels' view of the same: each request's first flat token (and the end), and
    # whether it starts from an empty state (cpu_kernels.Spans); None in a model without state
    # layers, whose steps need not build it.
    state_spans: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def num_reqs(self) -> int:
        return len(self.num_computed)

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.query_start, self.query_start[1:]))


def build_forward_batch(
    chunks: Sequence[SeqChunk], groups: Sequence[CacheGroup], block_size: int, device: torch.device | str
) -> ForwardBatch:
    """Per-request lists become tensors in a few calls each: the worker builds this every
    step, and one small tensor per request (or per token) cost milliseconds at 256 requests."""
    if not chunks:
        raise ValueError("a forward batch needs at least one request")
    lens = [len(c.token_ids) for c in chunks]
    if 0 in lens:
        raise ValueError(f"request {lens.index(0)} schedules no tokens")
    computed = [c.num_computed for c in chunks]
    starts = [0, *accumulate(lens)]
    num_reqs = len(chunks)

    def tensor(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    if starts[-1] == num_reqs:  # one token each: the decode step
        token_req = torch.arange(num_reqs, device=device)
        token_local = torch.zeros(num_reqs, dtype=torch.long, device=device)
        positions = tensor(computed)
    else:
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), tensor(lens))
        token_local = torch.arange(starts[-1], device=device) - tensor(starts[:-1])[token_req]
        positions = tensor(computed)[token_req] + token_local
    attn: dict[int, AttnMeta] = {}
    mamba: dict[int, torch.Tensor] = {}
    spans = None
    for g, group in enumerate(groups):
        if group.kind == "attention":
            meta = _attn_meta(chunks, lens, g, block_size, positions, token_req, device)
            attn.update({layer: meta for layer in group.layer_ids})
        else:
            slots = tensor([c.block_ids[g][0] for c in chunks])
            mamba.update({layer: slots for layer in group.layer_ids})
            if spans is None:
                fresh = torch.tensor([c == 0 for c in computed], dtype=torch.bool, device=device)
                spans = (tensor(starts), fresh)
    is_decode = [n == 1 and c > 0 for n, c in zip(lens, computed)]
    return ForwardBatch(
        input_ids=tensor(list(chain.from_iterable(c.token_ids for c in chunks))),
        positions=positions,
        token_req=token_req,
        token_local=token_local,
        query_start=tuple(starts),
        num_computed=tuple(computed),
        max_query_len=max(lens),
        logits_indices=tensor([s - 1 for s in starts[1:]]),
        block_size=block_size,
        attn=attn,
        mamba_slots=mamba,
        decode_reqs=tuple(r for r, d in enumerate(is_decode) if d),
        chunk_reqs=tuple(r for r, d in enumerate(is_decode) if not d),
        state_spans=spans,
    )


def _attn_meta(
    chunks: Sequence[SeqChunk],
    lens: Sequence[int],
    group: int,
    block_size: int,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    device: torch.device | str,
) -> AttnMeta:
    # Gather only the blocks that hold this request's K/V after the step; a request may own
    # more (look-ahead), and those must not be read.
    used = [cdiv(c.num_computed + n, block_size) for c, n in zip(chunks, lens)]
    width = max(used)
    rows = []
    for r, (c, u) in enumerate(zip(chunks, used)):
        ids = c.block_ids[group]
        if len(ids) < u:
            raise ValueError(f"request {r} has {len(ids)} blocks, needs {u}")
        rows.append([*ids[:u], *[0] * (width - u)])
    table = torch.tensor(rows, dtype=torch.long, device=device)
    valid = torch.arange(width, device=device)[None, :] < torch.tensor(used, device=device)[:, None]
    blocks, offsets = table[token_req, positions // block_size], positions % block_size
    on_kernel = cpu_kernels.usable(table)  # the C++ decode kernel needs no mask
    return AttnMeta(
        block_table=table,
        block_valid=valid,
        slot_mapping=blocks * block_size + offsets,
        write_blocks=blocks,
        write_offsets=offsets,
        padding=None if min(used) == width else padding_indices(valid),
        decode_mask=visible_slots(width * block_size, positions) if max(lens) == 1 and not on_kernel else None,
    )


def visible_slots(num_slots: int, positions: torch.Tensor) -> torch.Tensor:
    """[R, 1, 1, num_slots], SDPA's mask shape: which of its gathered slots each single-token
    request's query may see (those up to its position)."""
    slots = torch.arange(num_slots, device=positions.device)
    return (slots[None, :] <= positions[:, None])[:, None, None]


def padding_indices(valid: torch.Tensor) -> torch.Tensor:
    """Flat indices of the False entries of a block table's validity mask."""
    return (~valid).flatten().nonzero().squeeze(1)
