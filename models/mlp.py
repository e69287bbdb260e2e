"""The two dense MLPs the architectures use, sized by explicit widths so a mixture of
experts (models/moe.py) builds its experts and shared expert from the same classes."""

from __future__ import annotations

from typing import ClassVar

import torch

from models.layers import Linear, ProjectionStacks, relu2, silu_mul


class GatedMLP(ProjectionStacks):
    """SwiGLU (Qwen3, Qwen3.5 and their experts): down(silu(gate(x)) * up(x)). The gate and
    up projections run as one matmul once stacked."""

    STACKS: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.project("gate_up_proj", h)
        return self.down_proj(silu_mul(gate, up))


class Relu2MLP(torch.nn.Module):
    """NemotronH's MLP (its `mlp` layers and its experts): down(relu(up(x))²)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(h)))
