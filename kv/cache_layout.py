"""Unified page memory for hybrid models, as upstream's hybrid allocator lays it out.

Layers are split into cache groups of equal size per kind (attention, Mamba); each cache
buffer is one byte tensor of `num_blocks x page_bytes` shared by the i-th layer of every
group. A block id names the same page row in every buffer, so one pool serves all groups
and a page freed by a Mamba group can come back to an attention group. That reuse is why
stale fp32 state can be read as bf16 K/V, and why new attention blocks are zeroed.

Only the plan lives here, free of torch, because the engine sizes its block pool from it;
kv/cache_buffers.py allocates the memory in the worker.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from kv.cache_group import CacheGroup
from models.config import ModelConfig
from models.dtypes import DTYPE_BYTES

log = logging.getLogger(__name__)

_AUTO_BLOCK_MULTIPLE = 16


@dataclass(frozen=True, slots=True)
class CacheLayout:
    block_size: int
    num_blocks: int
    page_bytes: int
    attn_page_bytes: int
    mamba_page_bytes: int
    groups: tuple[CacheGroup, ...]
    buffers: tuple[tuple[int, ...], ...]  # layer ids sharing each byte buffer
    attn_dtype: str  # a name in models.dtypes.DTYPE_BYTES
    # The device type the worker keeps the pages on ("cpu", "cuda"): the engine, which loads
    # no torch, learns from it what "auto" became (a prefill engine's step budget: engine/build.py).
    device: str = "cpu"

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.page_bytes * len(self.buffers)


def _attn_page_bytes(cfg: ModelConfig, block_size: int, dtype: str) -> int:
    return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def _mamba_page_bytes(cfg: ModelConfig) -> int:
    # Mamba2 and Gated DeltaNet layers share the "mamba" group kind: both keep a conv window
    # and a recurrent state per request, overwritten in place and never zeroed.
    spec = cfg.state_spec
    if spec is None:
        return 0
    return 4 * (math.prod(spec.conv_state_shape) + math.prod(spec.ssm_state_shape))


def _split(layers: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [layers[i : i + size] for i in range(0, len(layers), size)]


def plan_groups(cfg: ModelConfig) -> tuple[tuple[CacheGroup, ...], tuple[tuple[int, ...], ...]]:
    """Groups of equal size per kind, and the buffers: buffer i holds the i-th layer of each group."""
    kinds = [
        (kind, layers) for kind, layers in (("attention", cfg.attention_layers), ("mamba", cfg.mamba_layers)) if layers
    ]
    size = min(len(layers) for _, layers in kinds)
    groups = tuple(CacheGroup(kind, part) for kind, layers in kinds for part in _split(layers, size))
    buffers = tuple(tuple(g.layer_ids[i] for g in groups if i < len(g.layer_ids)) for i in range(size))
    return groups, buffers


def auto_block_size(cfg: ModelConfig, attn_dtype: str) -> int:
    """The smallest multiple of 16 whose attention page holds a Mamba state, so neither kind
    wastes much. Tensor-parallel engines pass the full model's config: engines of every TP
    size must agree on the block size for PD to hand blocks over."""
    per_token = _attn_page_bytes(cfg, 1, attn_dtype)
    blocks = math.ceil(_mamba_page_bytes(cfg) / per_token / _AUTO_BLOCK_MULTIPLE)
    return max(_AUTO_BLOCK_MULTIPLE, blocks * _AUTO_BLOCK_MULTIPLE)


def plan_layout(
    cfg: ModelConfig,
    attn_dtype: str,
    block_size: int | None,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
) -> CacheLayout:
    """Pick the block size (when not given: `auto_block_size`) and the block count (given,
    or what `memory_bytes` holds)."""
    mamba = _mamba_page_bytes(cfg)
    if block_size is None:
        block_size = auto_block_size(cfg, attn_dtype)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    attn = _attn_page_bytes(cfg, block_size, attn_dtype)
    page = max(attn, mamba)
    groups, buffers = plan_groups(cfg)
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("give num_blocks or memory_bytes")
        num_blocks = memory_bytes // (page * len(buffers))
    if num_blocks < 1:
        raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
    layout = CacheLayout(block_size, num_blocks, page, attn, mamba, groups, buffers, attn_dtype)
    log.info(
        "KV cache layout: block_size=%d page=%dB (attention %dB, mamba %dB, padding %dB) blocks=%d buffers=%d "
        "groups=%s total=%.1fMiB",
        block_size,
        page,
        attn,
        mamba,
        page - min(attn, mamba) if mamba else 0,
        num_blocks,
        len(buffers),
        [(g.kind, g.layer_ids) for g in groups],
        layout.total_bytes / 2**20,
    )
    return layout
