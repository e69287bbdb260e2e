"""The page memory a `CacheLayout` plans, and each layer's typed views over it (the layout's
docstring says why the pages are shared)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kv.cache_layout import CacheLayout
from kv.nixl.host_pages import huge_page_zeros
from kv.nixl.read_descs import Pages
from models.batch import LayerCache
from models.config import ModelConfig


def page_buffer(num_blocks: int, page_bytes: int, device: torch.device | str) -> torch.Tensor:
    """One zeroed cache buffer, [num_blocks, page_bytes] bytes; on the host it sits on huge
    pages, which a same-host NIXL READ copies from fastest (kv/nixl/host_pages.py)."""
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
    tensor-parallel reader takes a head slice as one descriptor (kv/nixl/tp_slices.py)."""
    kv = buf[:, : layout.attn_page_bytes].view(getattr(torch, layout.attn_dtype))
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


def buffer_pages(buffers: Sequence[torch.Tensor], page_bytes: int, num_blocks: int) -> Pages:
    """The pages NIXL registers for `buffers`, which must be contiguous uint8
    `[num_blocks, page_bytes]` tensors on one CPU or CUDA device."""
    if not buffers:
        raise ValueError("the connector needs at least one buffer")
    device = buffers[0].device
    for i, buf in enumerate(buffers):
        if buf.dtype != torch.uint8 or buf.shape != (num_blocks, page_bytes) or not buf.is_contiguous():
            raise ValueError(
                f"buffer {i} must be a contiguous uint8 [{num_blocks}, {page_bytes}] tensor, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )
        if buf.device != device:
            raise ValueError(f"buffer {i} is on {buf.device}, buffer 0 on {device}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"NIXL registers CPU or CUDA memory, not {device.type}")
    # A CPU tensor has no device index; DRAM is device 0.
    return Pages(tuple(buf.data_ptr() for buf in buffers), page_bytes, num_blocks, device.index or 0)
