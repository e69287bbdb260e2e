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
from typing import Literal

import torch

LayerCache = tuple[torch.Tensor, torch.Tensor]
"""Attention: (K, V), each [num_blocks, block_size, kv_heads, head_dim] in the cache dtype.
Mamba: (conv state [num_blocks, conv_dim, kernel - 1], SSM state [num_blocks, heads, head_dim,
state]), fp32. Both are views over page memory owned by `kv/`."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of size `b` that `a` tokens take."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """Layers that share one block table: the i-th block of a request means the same page
    index for every layer of the group."""

    kind: Literal["attention", "mamba"]
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("attention", "mamba"):
            raise ValueError(f"unknown cache group kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a step: the tokens to compute now and where its cache lives."""

    token_ids: Sequence[int]
    num_computed: int
    block_ids: Sequence[Sequence[int]]  # one list per cache group, in group order


@dataclass(frozen=True, slots=True)
class AttnMeta:
    block_table: torch.Tensor  # [R, max_blocks] page indices, padded with 0
    block_valid: torch.Tensor  # [R, max_blocks] False where the table is padding
    slot_mapping: torch.Tensor  # [N] flat slot each new token's K/V is written to


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

    @property
    def num_reqs(self) -> int:
        return len(self.num_computed)

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    @property
    def decode_reqs(self) -> tuple[int, ...]:
        """Requests advancing by one token on top of existing state: run as one vector step."""
        return tuple(r for r, (n, c) in enumerate(zip(self.query_lens, self.num_computed)) if n == 1 and c > 0)


def build_forward_batch(
    chunks: Sequence[SeqChunk], groups: Sequence[CacheGroup], block_size: int, device: torch.device | str
) -> ForwardBatch:
    if not chunks:
        raise ValueError("a forward batch needs at least one request")
    ids: list[int] = []
    pos: list[int] = []
    req: list[int] = []
    local: list[int] = []
    starts = [0]
    for r, c in enumerate(chunks):
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"request {r} schedules no tokens")
        ids.extend(c.token_ids)
        pos.extend(range(c.num_computed, c.num_computed + n))
        req.extend([r] * n)
        local.extend(range(n))
        starts.append(starts[-1] + n)

    def tensor(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    positions = tensor(pos)
    token_req = tensor(req)
    attn: dict[int, AttnMeta] = {}
    mamba: dict[int, torch.Tensor] = {}
    for g, group in enumerate(groups):
        if group.kind == "attention":
            meta = _attn_meta(chunks, g, block_size, positions, token_req, device)
            attn.update({layer: meta for layer in group.layer_ids})
        else:
            slots = tensor([c.block_ids[g][0] for c in chunks])
            mamba.update({layer: slots for layer in group.layer_ids})
    return ForwardBatch(
        input_ids=tensor(ids),
        positions=positions,
        token_req=token_req,
        token_local=tensor(local),
        query_start=tuple(starts),
        num_computed=tuple(c.num_computed for c in chunks),
        max_query_len=max(len(c.token_ids) for c in chunks),
        logits_indices=tensor([s - 1 for s in starts[1:]]),
        block_size=block_size,
        attn=attn,
        mamba_slots=mamba,
    )


def _attn_meta(
    chunks: Sequence[SeqChunk],
    group: int,
    block_size: int,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    device: torch.device | str,
) -> AttnMeta:
    # Gather only the blocks that hold this request's K/V after the step; a request may own
    # more (look-ahead), and those must not be read.
    used = [cdiv(c.num_computed + len(c.token_ids), block_size) for c in chunks]
    for r, c in enumerate(chunks):
        if len(c.block_ids[group]) < used[r]:
            raise ValueError(f"request {r} has {len(c.block_ids[group])} blocks, needs {used[r]}")
    width = max(used)
    table = torch.zeros((len(chunks), width), dtype=torch.long)
    valid = torch.zeros((len(chunks), width), dtype=torch.bool)
    for r, c in enumerate(chunks):
        table[r, : used[r]] = torch.tensor(list(c.block_ids[group][: used[r]]), dtype=torch.long)
        valid[r, : used[r]] = True
    table = table.to(device)
    slots = table[token_req, positions // block_size] * block_size + positions % block_size
    return AttnMeta(block_table=table, block_valid=valid.to(device), slot_mapping=slots)
