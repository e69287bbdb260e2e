"""Mixture-of-experts MLP: Qwen3-MoE's and Qwen3.5-MoE's sparse MLP, NemotronH's `moe` layer
(docs/design.md §20).

A router picks `top_k` experts per token (`MoESpec` in models/config.py says how, exactly as
transformers computes it); the step's tokens are then grouped by expert, once: one sort of
the (token, expert) pairs, and each expert that was picked runs one matmul pair over all of
its rows. Nothing loops over tokens in Python, only over the experts that got any. Each
expert is an ordinary dense MLP (models/mlp.py) whose `Linear`s are stacked and packed like
every other: on a CPU its weights are then held in oneDNN's layout and a decode step's few
rows run on the panel kernel (docs/design.md §13); elsewhere it is `F.linear`.

Under tensor parallelism every rank holds every expert with its share of the intermediate
width, like the dense MLP (docs/design.md §11): the output is a partial sum the model
all-reduces, whatever the routing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from models import expert_group
from models.config import ModelConfig, MoESpec
from models.layers import Linear
from models.mlp import GatedMLP, Relu2MLP


class Router(nn.Module):
    """Per token: the chosen experts [T, top_k] and their weights (fp32 for NemotronH, whose
    router runs in fp32, else the input's dtype, as transformers has them)."""

    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden_size))
        if spec.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts))

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        """The correction bias stays fp32 when the model is cast (transformers keeps it so):
        it separates scores that differ in the last bits of a half-precision number."""
        bias = self._buffers.get("e_score_correction_bias")
        super()._apply(fn, recurse)
        if bias is not None:
            moved = self._buffers["e_score_correction_bias"]
            assert moved is not None
            self._buffers["e_score_correction_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.scoring == "softmax":
            logits = F.linear(x, self.weight)
            weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float).topk(self.spec.top_k, dim=-1)
            if self.spec.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), ids
        return self._grouped_sigmoid(F.linear(x.float(), self.weight.float()))

    def _grouped_sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if s.n_group > 1:
            groups = choice.view(-1, s.n_group, s.num_experts // s.n_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(s.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(-1, s.num_experts)
        ids = choice.topk(s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t, grouped by expert:
    the (token, k) pairs sorted by expert once, each picked expert run on its rows as one
    batch (on a CPU with the kernels, the experts side by side: models/expert_group.py), the
    weighted rows gathered back into (token, k) order and summed over k. The sum
    is in the weights' dtype. (A gather and a sum, not `index_add_`: on a busy CPU its
    threads made it the layer's slowest op.)"""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the one sync of the layer
    rows = x.index_select(0, order // top_k)
    grouped = expert_group.forward(experts, rows, counts)
    if grouped is None:
        outs, start = [], 0
        for expert, n in zip(experts, counts):
            if n:
                outs.append(expert(rows[start : start + n]))
                start += n
        grouped = torch.cat(outs)
    y = grouped * weights.reshape(-1, 1).index_select(0, order)
    return y.index_select(0, torch.argsort(order)).view(num_tokens, top_k, -1).sum(dim=1)


class MoE(nn.Module):
    """Routed experts plus the shared expert, under the checkpoint's own module names: Qwen's
    `gate`, `experts.N`, `shared_expert`, `shared_expert_gate`; NemotronH's `gate`,
    `experts.N`, `shared_experts`, `fc1_latent_proj`, `fc2_latent_proj`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        spec = cfg.moe
        assert spec is not None
        self.spec = spec
        hidden = cfg.hidden_size
        self.gate = Router(hidden, spec)
        inner = spec.latent_size or hidden
        if spec.latent_size is not None:
            self.fc1_latent_proj = Linear(hidden, inner, bias=cfg.mlp_bias)
            self.fc2_latent_proj = Linear(inner, hidden, bias=cfg.mlp_bias)
        experts: list[nn.Module] = [
            GatedMLP(inner, spec.intermediate_size) if spec.gated else Relu2MLP(inner, spec.intermediate_size, False)
            for _ in range(spec.num_experts)
        ]
        self.experts = nn.ModuleList(experts)
        # The shared expert's name in the checkpoint; None where there is none.
        self.shared_name: str | None = None
        if spec.shared_intermediate_size:
            self.shared_name = "shared_expert" if spec.gated else "shared_experts"
            shared = (
                GatedMLP(hidden, spec.shared_intermediate_size)
                if spec.gated
                else Relu2MLP(hidden, spec.shared_intermediate_size, cfg.mlp_bias)
            )
            self.add_module(self.shared_name, shared)
        if spec.shared_expert_gate:
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        weights, ids = self.gate(x)
        if self.spec.latent_size is None:
            out = run_experts(self.experts, x, weights, ids).to(h.dtype)
        else:
            out = self.fc2_latent_proj(run_experts(self.experts, self.fc1_latent_proj(x), weights, ids).to(h.dtype))
        if self.shared_name is not None:
            shared = self.get_submodule(self.shared_name)(x)
            if self.spec.shared_expert_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.view(h.shape)


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """A Qwen layer's MLP: the mixture where the config makes layer `layer` sparse, else SwiGLU."""
    return MoE(cfg) if cfg.is_moe_layer(layer) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
