"""The decoder stack Qwen3 and Qwen3.5 share: embedding, layers of two pre-norm residual
blocks (a token mixer, then an MLP), a final norm and the LM head.

The architectures differ in their layers only (which mixer, which norm), so a layer says how
it mixes through `mixer` (paged, one flat step) and `mixer_dense` (a batch from an empty
state, the reference path); the loops here are written once. Module names stay those of the
checkpoints (`model.layers.N.…`, `lm_head`), so weights load by name.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from models import decode_stack
from models.batch import ForwardBatch, LayerCache
from models.config import ModelConfig
from models.layers import Linear
from models.tensor_parallel import TPGroup


class PreNormLayer(Protocol):
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def mixer_dense(self, h: torch.Tensor) -> torch.Tensor: ...

    def mixer(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, layer: int) -> torch.Tensor: ...


class PreNormCausalLM(nn.Module):
    """`cfg` is this rank's local config under tensor parallelism (models/tensor_parallel.py):
    mixer and MLP outputs are partial sums until `tp.all_reduce`. `model` holds
    `embed_tokens`, `layers` and `norm`."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Embedding, model.embed_tokens).weight

    def _layers(self) -> list[PreNormLayer]:
        return cast(list[PreNormLayer], list(self.model.layers))

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Batched causal forward from an empty state: [B, T] -> logits [B, T, V] (fp32)."""
        h = self.model.embed_tokens(input_ids)
        for layer in self._layers():
            h = h + self.tp.all_reduce(layer.mixer_dense(layer.input_layernorm(h)))
            h = h + self.tp.all_reduce(layer.mlp(layer.post_attention_layernorm(h)))
        return self.lm_head(self.model.norm(h)).float()

    def forward(self, batch: ForwardBatch, caches: dict[int, LayerCache]) -> torch.Tensor:
        """One flat mixed step; returns fp32 logits of each request's last token [R, V]."""
        h = self.model.embed_tokens(batch.input_ids)
        fused = decode_stack.decode(self, h, batch, caches)
        if fused is not None:
            h = fused
        else:
            for i, layer in enumerate(self._layers()):
                h = h + self.tp.all_reduce(layer.mixer(layer.input_layernorm(h), batch, caches[i], i))
                h = h + self.tp.all_reduce(layer.mlp(layer.post_attention_layernorm(h)))
        return self.lm_head(self.model.norm(h[batch.logits_indices])).float()
