"""NemotronH-style hybrid decoder: the layer sequence is Mamba2 (`M`), attention (`*`), MLP
(`-`) and mixture-of-experts (`E`, models/moe.py) blocks, each a pre-norm residual block, as
transformers' NemotronHForCausalLM reads its `hybrid_override_pattern` (`layers_block_type`). Its attention has no positional embedding: order
comes from the Mamba layers."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from models import decode_stack
from models.attention import dense_causal_attention, paged_attention
from models.batch import ForwardBatch, LayerCache
from models.config import ModelConfig
from models.layers import Linear, ProjectionStacks, RMSNorm
from models.mamba import Mamba2Mixer
from models.mlp import Relu2MLP
from models.moe import MoE
from models.tensor_parallel import SINGLE, TPGroup


class Attention(ProjectionStacks):
    """q, k and v run as one matmul once stacked."""

    STACKS: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = h.shape[:-1]
        q, k, v = self.project("qkv_proj", h)
        return (
            q.view(*shape, self.heads, self.head_dim),
            k.view(*shape, self.kv_heads, self.head_dim),
            v.view(*shape, self.kv_heads, self.head_dim),
        )

    def forward_dense(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(h)
        return self.o_proj(dense_causal_attention(q, k, v, self.scale).flatten(-2))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, layer: int) -> torch.Tensor:
        q, k, v = self._qkv(h)
        out = paged_attention(q, k, v, cache[0], cache[1], batch, batch.attn[layer], self.scale)
        return self.o_proj(out.flatten(-2))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, tp: TPGroup) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=True)
        if kind == "mamba":
            assert cfg.mamba is not None
            self.mixer: nn.Module = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.norm_eps, cfg.use_bias, tp)
        elif kind == "attention":
            self.mixer = Attention(cfg)
        elif kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = Relu2MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, kind, tp) for kind in cfg.layer_kinds)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=True)


class NemotronHForCausalLM(nn.Module):
    """`cfg` is this rank's local config under tensor parallelism (models/tensor_parallel.py):
    each block's output is a partial sum until `tp.all_reduce`."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = Backbone(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Batched causal forward from an empty state: [B, T] -> logits [B, T, V] (fp32)."""
        h = self.model.embeddings(input_ids)
        for block in self.model.layers:
            mixer = block.mixer
            x = block.norm(h)
            h = h + self.tp.all_reduce(mixer.forward_dense(x) if block.kind in ("mamba", "attention") else mixer(x))
        return self.lm_head(self.model.norm_f(h)).float()

    def forward(self, batch: ForwardBatch, caches: dict[int, LayerCache]) -> torch.Tensor:
        """One flat mixed step; returns fp32 logits of each request's last token [R, V]."""
        h = self.model.embeddings(batch.input_ids)
        fused = decode_stack.decode(self, h, batch, caches)
        if fused is not None:
            h = fused
        else:
            for i, block in enumerate(self.model.layers):
                x = block.norm(h)
                if block.kind == "mamba":
                    conv, ssm = caches[i]
                    x = block.mixer(x, batch, conv, ssm, batch.mamba_slots[i])
                elif block.kind == "attention":
                    x = block.mixer(x, batch, caches[i], i)
                else:
                    x = block.mixer(x)
                h = h + self.tp.all_reduce(x)
        return self.lm_head(self.model.norm_f(h[batch.logits_indices])).float()
