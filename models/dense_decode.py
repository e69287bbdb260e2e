"""A dense Qwen3 stack's decode step as one C++ call (docs/design.md §13).

On a CPU at batch 1 the step of a ~0.6B Qwen3 is ~85% the weights' reads, at the machine's
bandwidth, and ~15% the Python and dispatch of its ~400 small calls, while the second thread
waits. `DenseDecodeStack` (kernels/cpu/csrc/cpu_kernels.cpp) runs the same kernels and ATen
ops in the same order as the layers' forward on a step of single-token requests, so its
output is theirs bit for bit; anything else (a prefill chunk in the step, tensor parallelism,
a mixture of experts, weights not packed, the kernels off, another dtype) takes the layers'
own forward.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch import nn

from kernels.cpu import ops as cpu_kernels
from models.batch import ForwardBatch, LayerCache
from models.layers import Linear, Rotary, StackedLinear
from models.mlp import GatedMLP


def _projection(kernels: Any, linear: nn.Module | None) -> Any | None:
    """The C++ view of a packed fp32 `Linear`, or None where it cannot be one."""
    if not isinstance(linear, Linear) or linear.packed is None:
        return None
    return kernels.Projection(linear.panels, linear.packed, linear.bias, linear.out_features)


def build_stack(model: nn.Module) -> Any | None:
    """The decode stack of a Qwen3 model (`Qwen3ForCausalLM`) as the installed kernel choice
    runs it, or None where some layer cannot run in it."""
    choice = cpu_kernels.installed()
    kernels = cpu_kernels.load() if choice.on else None
    if kernels is None or model.tp.size != 1:
        return None
    layers = list(model.model.layers)
    first = layers[0].self_attn
    stack = kernels.DenseDecodeStack(
        first.heads,
        first.kv_heads,
        first.head_dim,
        layers[0].input_layernorm.eps,
        first.q_norm.eps,
        first.scale,
        choice.panel_rows,
        choice.vector_bits or cpu_kernels.panel_vector_bits(),
    )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP) or not isinstance(attn.stacked("qkv_proj"), StackedLinear):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qk_norm_weight)
        if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in norms):
            return None
        parts = [
            _projection(kernels, m) for m in (attn.qkv_proj, attn.o_proj, mlp.stacked("gate_up_proj"), mlp.down_proj)
        ]
        if any(p is None for p in parts):
            return None
        stack.add_layer(*(w.detach() for w in norms), *parts)
    return stack


# Each model's stack and the kernel choice it was built under: a choice installed later (a
# test's `cpu_kernels.using`) builds it again. Kept beside the module, not on it: a C++
# stack cannot be deep-copied with it.
_STACKS: weakref.WeakKeyDictionary[nn.Module, tuple[cpu_kernels.KernelChoice, Any]] = weakref.WeakKeyDictionary()


def decode(model: nn.Module, batch: ForwardBatch, caches: dict[int, LayerCache]) -> torch.Tensor | None:
    """The step's hidden states after the last layer [N, hidden], or None where the step is not
    one the stack runs (the caller then runs the layers)."""
    if batch.max_query_len != 1 or torch.is_grad_enabled():
        return None
    choice = cpu_kernels.installed()
    built = _STACKS.get(model)
    if built is None or built[0] is not choice:
        built = _STACKS[model] = (choice, build_stack(model))
    stack = built[1]
    num_layers = len(caches)
    meta = batch.attn.get(0)
    if stack is None or meta is None or any(batch.attn.get(i) is not meta for i in range(num_layers)):
        return None
    k_caches = [caches[i][0] for i in range(num_layers)]
    v_caches = [caches[i][1] for i in range(num_layers)]
    if any(c.dtype != torch.float32 or c.device.type != "cpu" for c in (*k_caches, *v_caches)):
        return None
    h = model.model.embed_tokens(batch.input_ids)
    if h.dtype != torch.float32 or h.device.type != "cpu":
        return None
    rotary = cast(Rotary, model.get_submodule("model.layers.0.self_attn.rotary"))
    cos, sin = rotary.table(batch.positions, h.dtype)
    return stack.forward(
        h,
        k_caches,
        v_caches,
        meta.write_blocks,
        meta.write_offsets,
        meta.block_table,
        batch.positions,
        cos,
        sin,
    )
