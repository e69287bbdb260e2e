"""Qwen3.5-style hybrid decoder (the text model of transformers' `qwen3_5`).

Each layer is a token mixer and a SwiGLU MLP (Qwen3.5-MoE: a mixture of SwiGLU experts with a
gated shared expert, models/moe.py), both pre-norm residual blocks. The mixer is
Gated DeltaNet (`linear_attention`, state in a "mamba"-kind state page) or gated full
attention (`full_attention`, K/V in paged attention blocks), as the config's `layer_types`
say. The full attention differs from Qwen3's in three ways: `q_proj` also yields a per-head
output gate (`out * sigmoid(gate)`), RoPE turns only the first `partial_rotary_factor` of
each head, and every RMSNorm scales by `1 + weight` (weights are stored zero-centred).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from models.attention import dense_causal_attention, paged_attention
from models.batch import ForwardBatch, LayerCache
from models.config import ModelConfig
from models.gated_deltanet import GatedDeltaNet
from models.layers import Linear, ProjectionStacks, Rotary
from models.moe import feed_forward
from models.pre_norm import PreNormCausalLM
from models.tensor_parallel import SINGLE, TPGroup


class ZeroCenteredRMSNorm(nn.Module):
    """RMS norm that scales by `1 + weight`, in fp32, cast back after the scaling."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(ProjectionStacks):
    """q (with its gate), k and v run as one matmul once stacked."""

    STACKS: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.rope_theta is not None
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.norm_eps)
        self.rotary_dim = int(self.head_dim * cfg.partial_rotary_factor)
        self.rotary = Rotary(self.rotary_dim, cfg.rope_theta)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.rotary(x[..., : self.rotary_dim], positions), x[..., self.rotary_dim :]], dim=-1)

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [..., heads, head_dim] and the output gate [..., heads * head_dim]."""
        shape = h.shape[:-1]
        q_gate, k, v = self.project("qkv_proj", h)
        # Per head, q_proj's output is [query | gate]: split per head, not down the middle.
        q, gate = q_gate.view(*shape, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(*shape, self.kv_heads, self.head_dim))
        v = v.view(*shape, self.kv_heads, self.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v, gate.reshape(*shape, -1)

    def forward_dense(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = self._qkv(h, torch.arange(h.shape[1], device=h.device))
        out = dense_causal_attention(q, k, v, self.scale).flatten(-2)
        return self.o_proj(out * torch.sigmoid(gate))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, layer: int) -> torch.Tensor:
        q, k, v, gate = self._qkv(h, batch.positions)
        out = paged_attention(q, k, v, cache[0], cache[1], batch, batch.attn[layer], self.scale).flatten(-2)
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3_5Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mamba":
            assert cfg.gated_delta_net is not None
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.gated_delta_net, cfg.norm_eps)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = feed_forward(cfg, index)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.norm_eps)

    def mixer_dense(self, h: torch.Tensor) -> torch.Tensor:
        mixer = self.linear_attn if self.kind == "mamba" else self.self_attn
        return mixer.forward_dense(h)

    def mixer(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, layer: int) -> torch.Tensor:
        if self.kind == "mamba":
            return self.linear_attn(h, batch, cache[0], cache[1], batch.mamba_slots[layer])
        return self.self_attn(h, batch, cache, layer)


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5Layer(cfg, kind, i) for i, kind in enumerate(cfg.layer_kinds))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.norm_eps)


class Qwen3_5ForCausalLM(PreNormCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp, Qwen3_5Model(cfg))
