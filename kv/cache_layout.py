"""Unified page memory for hybrid models, as upstream's hybrid allocator lays it out.

Layers are split into cache groups of equal size per kind (attention, Mamba); each cache
buffer is one byte tensor of `num_blocks x page_bytes` shared by the i-th layer of every
group. A block id names the same page row in every buffer, so one pool serves all groups
and a page freed by a Mamba group can come back to an attention group. That reuse is why
stale fp32 state can be read as bf16 K/V, and why new attention blocks are zeroed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kv.host_pages import huge_page_zeros
from models.batch import CacheGroup, LayerCache
from models.config import ModelConfig

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
    attn_dtype: torch.dtype

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.page_bytes * len(self.buffers)


def _attn_page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


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


def auto_block_size(cfg: ModelConfig, attn_dtype: torch.dtype) -> int:
    """The smallest multiple of 16 whose attention page holds a Mamba state, so neither kind
    wastes much. Tensor-parallel engines pass the full model's config: engines of every TP
    size must agree on the block size for PD to hand blocks over."""
    per_token = _attn_page_bytes(cfg, 1, attn_dtype)
    blocks = math.ceil(_mamba_page_bytes(cfg) / per_token / _AUTO_BLOCK_MULTIPLE)
    return max(_AUTO_BLOCK_MULTIPLE, blocks * _AUTO_BLOCK_MULTIPLE)


def plan_layout(
    cfg: ModelConfig,
    attn_dtype: torch.dtype,
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


def page_buffer(num_blocks: int, page_bytes: int, device: torch.device | str) -> torch.Tensor:
    """One zeroed cache buffer, [num_blocks, page_bytes] bytes; on the host it sits on huge
    pages, which a same-host NIXL READ copies from fastest (kv/host_pages.py)."""
    if torch.device(device).type == "cpu":
        return huge_page_zeros(num_blocks, page_bytes)
    return torch.zeros((num_blocks, page_bytes), dtype=torch.uint8, device=device)


def allocate_caches(
    layout: CacheLayout, cfg: ModelConfig, device: torch.device | str
) -> tuple[list[torch.Tensor], dict[int, LayerCache]]:
    """Allocate the byte buffers and build each layer's typed views over them.

    Memory starts zeroed, so a dense model's pages only ever hold K/V of one dtype; in a
    hybrid model a page keeps whatever its last owner left, which is what zero-on-allocate
    is for."""
    buffers = [page_buffer(layout.num_blocks, layout.page_bytes, device) for _ in layout.buffers]
    kinds = {layer: g.kind for g in layout.groups for layer in g.layer_ids}
    views: dict[int, LayerCache] = {}
    for buf, layers in zip(buffers, layout.buffers):
        for layer in layers:
            views[layer] = _attn_view(buf, layout, cfg) if kinds[layer] == "attention" else _mamba_view(buf, cfg)
    return buffers, views


def _attn_view(buf: torch.Tensor, layout: CacheLayout, cfg: ModelConfig) -> LayerCache:
    """K and V as `[num_blocks, block_size, kv_heads, head_dim]` over head-major pages
    (`[2, kv_heads, block_size, head_dim]`): one head's tokens are one run of bytes, so a
    tensor-parallel reader takes a head slice as one descriptor (kv/tp_slices.py)."""
    kv = buf[:, : layout.attn_page_bytes].view(layout.attn_dtype)
    kv = kv.view(layout.num_blocks, 2, cfg.num_key_value_heads, layout.block_size, cfg.head_dim)
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def _mamba_view(buf: torch.Tensor, cfg: ModelConfig) -> LayerCache:
    spec = cfg.state_spec
    assert spec is not None
    conv_bytes = 4 * math.prod(spec.conv_state_shape)
    ssm_bytes = 4 * math.prod(spec.ssm_state_shape)
    n = buf.shape[0]
    conv = buf[:, :conv_bytes].view(torch.float32).view(n, *spec.conv_state_shape)
    ssm = buf[:, conv_bytes : conv_bytes + ssm_bytes].view(torch.float32).view(n, *spec.ssm_state_shape)
    return conv, ssm
