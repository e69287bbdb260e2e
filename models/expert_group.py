"""A mixture-of-experts layer's routed experts as one C++ call (docs/design.md §20).

`ExpertGroup` (kernels/cpu/csrc/cpu_kernels.cpp) runs each picked expert on one thread, the
experts side by side, where the layer's Python loop ran them one after another with each
expert's matmuls split across the threads. Built for experts that are SwiGLU or relu^2 MLPs
with packed fp32 CPU weights, under the installed kernel choice; anything else (the kernels
off, weights not packed, another dtype or device, gradients) takes the loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels.cpu import ops as cpu_kernels
from models.layers import Linear
from models.mlp import GatedMLP, Relu2MLP


class _Ungrouped(Exception):
    """An expert the group cannot run: the layer keeps its loop."""


def _projection(kernels: Any, linear: nn.Module | None) -> Any:
    if not isinstance(linear, Linear) or linear.packed is None:
        raise _Ungrouped
    return kernels.Projection(linear.panels, linear.packed, linear.bias, linear.out_features)


def build(experts: nn.ModuleList) -> Any | None:
    """The C++ group of `experts` as the installed kernel choice runs them, or None where one
    of them cannot run in it."""
    choice = cpu_kernels.installed()
    kernels = cpu_kernels.load() if choice.on else None
    if kernels is None or not len(experts):
        return None
    gated = isinstance(experts[0], GatedMLP)
    group = kernels.ExpertGroup(gated, choice.panel_rows, choice.vector_bits or cpu_kernels.panel_vector_bits())
    try:
        for expert in experts:
            first: nn.Module | None
            if gated and isinstance(expert, GatedMLP):
                first = expert.stacked("gate_up_proj")
            elif not gated and isinstance(expert, Relu2MLP):
                first = expert.up_proj
            else:
                raise _Ungrouped
            group.add(_projection(kernels, first), _projection(kernels, expert.down_proj))
    except _Ungrouped:
        return None
    return group


# Each layer's group, built again under a later kernel choice.
_GROUPS: cpu_kernels.PerChoice[nn.ModuleList, Any | None] = cpu_kernels.PerChoice(build)


def group(experts: nn.ModuleList) -> Any | None:
    """The layer's group under the installed kernel choice, built once for it (the decode stack
    runs the same one: models/decode_stack.py), or None where it cannot run."""
    return _GROUPS.get(experts)


def forward(experts: nn.ModuleList, rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """Each row's expert output: `rows` [R, hidden] hold `counts[e]` rows of expert e, in
    expert order. None where the group does not run these rows (the caller then loops)."""
    if torch.is_grad_enabled() or rows.dtype != torch.float32 or rows.device.type != "cpu":
        return None
    built = group(experts)
    return None if built is None else built.forward(rows.contiguous(), counts)
