"""A decode step through a model's layers as one C++ call (docs/design.md §13).

On a CPU at batch 1 the step of a ~0.6B model is ~85% the weights' reads, at the machine's
bandwidth, and ~15% the Python and dispatch of its ~400 small calls, while the second thread
waits. `DecodeStack` (kernels/cpu/csrc/cpu_kernels.cpp) runs the same kernels and ATen ops in
the same order as the layers' forward on a step of single-token requests, so its output is
theirs bit for bit. Built here for Qwen3 (attention with q/k norm and rotation, SwiGLU MLPs)
and NemotronH (Mamba2, attention, relu^2 MLPs), with their mixtures of experts (the routing
and regrouping of models/moe.py, the experts side by side as models/expert_group.py runs
them); anything else takes the layers' own forward: a prefill chunk in the step, tensor
parallelism, Qwen3.5's gated shared expert, weights not packed, the kernels off, another
dtype, attention layers in more than one cache group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from kernels.cpu import ops as cpu_kernels
from models import expert_group
from models.batch import ForwardBatch, LayerCache
from models.layers import GatedRMSNorm, Linear, ProjectionStacks, RMSNorm, Rotary, StackedLinear
from models.mamba import Mamba2Mixer
from models.mlp import GatedMLP, Relu2MLP
from models.moe import MoE


class _Unfused(Exception):
    """A layer the stack cannot run: the model keeps its layers' forward."""


@dataclass(frozen=True, slots=True)
class _Fused:
    stack: Any  # the C++ DecodeStack
    attention: tuple[int, ...]  # layer ids, in block order
    mamba: tuple[int, ...]
    rotary: Rotary | None  # Qwen3's: q and k are rotated


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise _Unfused
    return [t.detach() for t in tensors]


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float]:
    if not isinstance(norm, RMSNorm):
        raise _Unfused
    return _fp32(norm.weight)[0], norm.eps


def _projection(kernels: Any, linear: nn.Module | None) -> Any:
    """The C++ view of a packed fp32 `Linear`."""
    if not isinstance(linear, Linear) or linear.packed is None:
        raise _Unfused
    return kernels.Projection(linear.panels, linear.packed, linear.bias, linear.out_features)


def _stacked(module: nn.Module, stack: str) -> StackedLinear:
    fused = module.stacked(stack) if isinstance(module, ProjectionStacks) else None
    if fused is None:
        raise _Unfused
    return fused


def _dense(kernels: Any, mlp: nn.Module) -> tuple[Any, Any]:
    """A SwiGLU or relu^2 MLP's two projections, in the C++ view."""
    if isinstance(mlp, GatedMLP):
        return _projection(kernels, _stacked(mlp, "gate_up_proj")), _projection(kernels, mlp.down_proj)
    if isinstance(mlp, Relu2MLP):
        return _projection(kernels, mlp.up_proj), _projection(kernels, mlp.down_proj)
    raise _Unfused


def _mlp(kernels: Any, stack: Any, norm: nn.Module, mlp: nn.Module) -> None:
    if isinstance(mlp, MoE):
        stack.add_moe(*_norm(norm), _moe(kernels, mlp))
    elif isinstance(mlp, GatedMLP):
        stack.add_swiglu(*_norm(norm), *_dense(kernels, mlp))
    else:
        stack.add_relu2(*_norm(norm), *_dense(kernels, mlp))


def _moe(kernels: Any, moe: MoE) -> Any:
    """A mixture's router, experts, latent projections and shared expert, in the C++ view."""
    spec = moe.spec
    if spec.shared_expert_gate:
        raise _Unfused  # Qwen3.5's, whose linear-attention layers the stack does not run
    experts = expert_group.group(moe.experts)
    if experts is None:
        raise _Unfused
    correction = _fp32(moe.gate.e_score_correction_bias)[0] if spec.scoring == "sigmoid" else None
    router = kernels.RouterParams(
        _fp32(moe.gate.weight)[0],
        correction,
        spec.top_k,
        spec.n_group,
        spec.topk_group,
        spec.norm_topk_prob,
        spec.routed_scaling_factor,
    )
    latent = (None, None)
    if spec.latent_size is not None:
        latent = (_projection(kernels, moe.fc1_latent_proj), _projection(kernels, moe.fc2_latent_proj))
    shared = (None, None) if moe.shared_name is None else _dense(kernels, moe.get_submodule(moe.shared_name))
    return kernels.MoEParams(router, experts, *latent, *shared, spec.gated)


def _mamba2(kernels: Any, stack: Any, norm: nn.Module, mixer: Mamba2Mixer) -> None:
    s = mixer.spec
    gated = mixer.norm
    if not isinstance(gated, GatedRMSNorm) or s.intermediate_size % gated.group_size:
        raise _Unfused  # a group across tensor-parallel ranks
    conv_weight, dt_bias, d, norm_weight = _fp32(mixer.conv1d.weight, mixer.dt_bias, mixer.D, gated.weight)
    conv_bias = None if mixer.conv1d.bias is None else _fp32(mixer.conv1d.bias)[0]
    a = -torch.exp(mixer.A_log.detach().float())  # what the mixer computes every step
    shape = kernels.MambaShape(s.intermediate_size, s.conv_dim, s.num_heads, s.head_dim, s.n_groups, s.state_size)
    params = kernels.MambaParams(
        conv_weight, conv_bias, dt_bias, a, d, norm_weight, s.time_step_min, gated.eps, gated.group_size
    )
    stack.add_mamba2(
        *_norm(norm), _projection(kernels, mixer.in_proj), _projection(kernels, mixer.out_proj), shape, params
    )


def _blocks(model: nn.Module) -> Iterator[tuple[int, str, nn.Module, nn.Module]]:
    """(layer id, kind, norm, mixer) of each residual block, in order."""
    from models.nemotron_h import NemotronHForCausalLM
    from models.qwen3 import Qwen3ForCausalLM

    layers = list(cast(nn.ModuleList, model.model.layers))
    if isinstance(model, Qwen3ForCausalLM):
        for i, layer in enumerate(layers):
            yield i, "attention", layer.input_layernorm, layer.self_attn
            yield i, "mlp", layer.post_attention_layernorm, layer.mlp
    elif isinstance(model, NemotronHForCausalLM):
        for i, block in enumerate(layers):
            yield i, block.kind, block.norm, block.mixer
    else:
        raise _Unfused


def build(model: nn.Module) -> _Fused | None:
    """The decode stack of a Qwen3 or NemotronH model as the installed kernel choice runs it, or
    None where some layer cannot run in it."""
    choice = cpu_kernels.installed()
    kernels = cpu_kernels.load() if choice.on else None
    if kernels is None or model.tp.size != 1:
        return None
    try:
        return _build(kernels, choice, list(_blocks(model)))
    except _Unfused:
        return None


def _build(
    kernels: Any, choice: cpu_kernels.KernelChoice, blocks: list[tuple[int, str, nn.Module, nn.Module]]
) -> _Fused:
    first = next((mixer for _, kind, _, mixer in blocks if kind == "attention"), None)
    heads, kv_heads, head_dim, scale = (
        (0, 0, 0, 0.0) if first is None else (first.heads, first.kv_heads, first.head_dim, first.scale)
    )
    # Qwen3's attention normalises and rotates q and k (its stacked norm weights, one rotary
    # table for every layer); NemotronH's does neither.
    rotated = first is not None and hasattr(first, "qk_norm_weight")
    qk_eps = first.q_norm.eps if rotated else 0.0
    rotary = cast(Rotary, first.rotary) if rotated else None
    bits = choice.vector_bits or cpu_kernels.panel_vector_bits()
    stack = kernels.DecodeStack(heads, kv_heads, head_dim, scale, qk_eps, choice.panel_rows, bits)
    attention: list[int] = []
    mamba: list[int] = []
    for i, kind, norm, mixer in blocks:
        if kind == "attention":
            qk_norm = _fp32(mixer.qk_norm_weight)[0] if rotated else None
            qkv, o = _projection(kernels, _stacked(mixer, "qkv_proj")), _projection(kernels, mixer.o_proj)
            stack.add_attention(*_norm(norm), qkv, o, qk_norm)
            attention.append(i)
        elif kind == "mamba" and isinstance(mixer, Mamba2Mixer):
            _mamba2(kernels, stack, norm, mixer)
            mamba.append(i)
        elif kind in ("mlp", "moe"):
            _mlp(kernels, stack, norm, mixer)
        else:
            raise _Unfused
    return _Fused(stack, tuple(attention), tuple(mamba), rotary)


# Each model's stack, built again under a later kernel choice.
_STACKS: cpu_kernels.PerChoice[nn.Module, _Fused | None] = cpu_kernels.PerChoice(build)


def decode(
    model: nn.Module, h: torch.Tensor, batch: ForwardBatch, caches: dict[int, LayerCache]
) -> torch.Tensor | None:
    """The step's hidden states after the last layer [N, hidden] from its embedded tokens `h`,
    or None where the step is not one the stack runs (the caller then runs the layers)."""
    if batch.max_query_len != 1 or torch.is_grad_enabled() or h.dtype != torch.float32 or h.device.type != "cpu":
        return None
    fused = _STACKS.get(model)
    if fused is None:
        return None
    meta = batch.attn.get(fused.attention[0]) if fused.attention else None
    if any(batch.attn.get(i) is not meta for i in fused.attention):
        return None  # attention layers in several cache groups
    k_caches = [caches[i][0] for i in fused.attention]
    v_caches = [caches[i][1] for i in fused.attention]
    conv = [caches[i][0] for i in fused.mamba]
    ssm = [caches[i][1] for i in fused.mamba]
    if any(c.dtype != torch.float32 or c.device.type != "cpu" for c in (*k_caches, *v_caches, *conv, *ssm)):
        return None
    cos, sin = fused.rotary.table(batch.positions, h.dtype) if fused.rotary is not None else (None, None)
    starts, fresh = batch.state_spans if batch.state_spans is not None else (None, None)
    return fused.stack.forward(
        h,
        k_caches,
        v_caches,
        None if meta is None else meta.write_blocks,
        None if meta is None else meta.write_offsets,
        None if meta is None else meta.block_table,
        batch.positions,
        cos,
        sin,
        conv,
        ssm,
        [batch.mamba_slots[i] for i in fused.mamba],
        starts,
        fresh,
    )
