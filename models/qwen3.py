"""Qwen3 decoder: GQA attention with q/k RMSNorm and RoPE, a SwiGLU MLP or, in Qwen3-MoE's
sparse layers, a mixture of SwiGLU experts (models/moe.py)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kernels.cpu import ops as cpu_kernels
from models.attention import dense_causal_attention, paged_attention
from models.batch import ForwardBatch, LayerCache
from models.config import ModelConfig
from models.layers import Linear, ProjectionStacks, RMSNorm, Rotary
from models.moe import feed_forward
from models.pre_norm import PreNormCausalLM
from models.tensor_parallel import SINGLE, TPGroup


class Qwen3Attention(ProjectionStacks):
    """q, k and v run as one matmul once stacked."""

    STACKS: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.rope_theta is not None
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, weight_in_fp32=False)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, weight_in_fp32=False)
        self.rotary = Rotary(self.head_dim, cfg.rope_theta)

    def stack_projections(self) -> None:
        """One matmul for q, k and v; q and k then normalised and rotated as one tensor, the two
        norms' weights stacked per head. The same arithmetic in fewer calls: at batch 1 a Qwen3
        step is mostly such small calls besides the weights' reads."""
        super().stack_projections()
        weights = [
            self.q_norm.weight.detach().expand(self.heads, -1),
            self.k_norm.weight.detach().expand(self.kv_heads, -1),
        ]
        self.register_buffer("qk_norm_weight", torch.cat(weights), persistent=False)

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = h.shape[:-1]
        qkv_proj = self.stacked("qkv_proj")
        if qkv_proj is None:
            q, k, v = self.project("qkv_proj", h)
            q = self.q_norm(q.view(*shape, self.heads, self.head_dim))
            k = self.k_norm(k.view(*shape, self.kv_heads, self.head_dim))
            v = v.view(*shape, self.kv_heads, self.head_dim)
            return self.rotary(q, positions), self.rotary(k, positions), v
        qkv = qkv_proj(h).view(*shape, self.heads + 2 * self.kv_heads, self.head_dim)
        qk = qkv[..., : self.heads + self.kv_heads, :]
        if qkv.dim() == 3 and qkv.dtype == torch.float32 and cpu_kernels.usable(qkv, self.qk_norm_weight):
            # A flat step on a CPU: norm, weight and rotation in one kernel pass (docs/design.md §13).
            cos, sin = self.rotary.table(positions, qkv.dtype)
            qk = cpu_kernels.qk_norm_rope(qk, self.qk_norm_weight, cos, sin, self.q_norm.eps)
        else:
            qk = self.rotary(self.q_norm.normalize(qk) * self.qk_norm_weight, positions)
        return qk[..., : self.heads, :], qk[..., self.heads :, :], qkv[..., self.heads + self.kv_heads :, :]

    def forward_dense(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device)
        q, k, v = self._qkv(h, positions)
        return self.o_proj(dense_causal_attention(q, k, v, self.scale).flatten(-2))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, layer: int) -> torch.Tensor:
        q, k, v = self._qkv(h, batch.positions)
        out = paged_attention(q, k, v, cache[0], cache[1], batch, batch.attn[layer], self.scale)
        return self.o_proj(out.flatten(-2))


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)
        self.mlp = feed_forward(cfg, index)

    def mixer_dense(self, h: torch.Tensor) -> torch.Tensor:
        return self.self_attn.forward_dense(h)

    def mixer(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, layer: int) -> torch.Tensor:
        return self.self_attn(h, batch, cache, layer)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(cfg, i) for i in range(len(cfg.layer_kinds)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)


class Qwen3ForCausalLM(PreNormCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp, Qwen3Model(cfg))
