"""Small building blocks shared by the model definitions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import ClassVar, cast

import torch
from torch import nn
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from kernels.cpu.huge_pages import collapse
from kernels.cpu.onednn_panels import panels_of
from models.tensor_parallel import SINGLE, TPGroup

# The batch size oneDNN lays a packed weight out for; any other size reads it as well
# (1-1024 rows measured: at or above the unpacked matmul everywhere).
_PACK_ROWS = 32


class Linear(nn.Linear):
    """`nn.Linear` that, once `pack`ed, runs its fp32 CPU inference on a weight held in oneDNN's
    blocked layout. torch's own fp32 CPU matmul (MKL) reads the plain [out, in] weight; on this
    machine's AMD EPYC the packed oneDNN matmul was 1.2x faster at one row (a decode step at
    batch 1 streams every weight once), 1.5-1.9x at 4-16 rows and 1.05-1.3x at 64-1024, with
    the weights out of cache. Unpacked (training, half precision, other devices) it is
    `nn.Linear` as is: oneDNN's op has no autograd. Where the installed `KernelChoice` runs
    panel_linear, a few rows (a decode step) read the packed buffer with that kernel instead
    (docs/design.md §13)."""

    packed: torch.Tensor | None = None
    # `packed`'s own buffer as the few-row kernel reads it (a view that holds `packed`), where
    # the installed kernel choice runs panel_linear and the buffer is the checked layout.
    panels: torch.Tensor | None = None

    def pack(self, keep_weight: bool) -> None:
        """Lay the weight out for oneDNN. The plain weight is then dead weight in memory and is
        released unless `keep_weight` (a weight shared with another module, as a tied LM head
        shares the embedding's)."""
        weight = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
        self.panels = panels_of(self.packed, weight) if cpu_kernels.installed().panel_rows else None
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if self.panels is not None:
                # Up to the installed choice's row limit (none where it turned the kernels off).
                kernels = cpu_kernels.installed()
                if x.numel() <= kernels.panel_rows * self.in_features:
                    return cpu_kernels.panel_linear(x, self.panels, self.bias, self.out_features, kernels.vector_bits)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class StackedLinear(Linear):
    """One `Linear` whose output is its parts' outputs side by side (their weights stacked by
    rows). On a CPU at small batches a step is a chain of small calls: one matmul for q, k and
    v reads the input once and costs one call's overhead instead of three."""

    def __init__(self, parts: Sequence[Linear]) -> None:
        first = parts[0]
        biases = [p.bias for p in parts if p.bias is not None]
        if biases and len(biases) != len(parts):
            raise ValueError("StackedLinear: either every part has a bias or none has")
        self.sizes = tuple(p.out_features for p in parts)
        super().__init__(
            first.in_features, sum(self.sizes), bias=bool(biases), device=first.weight.device, dtype=first.weight.dtype
        )
        with torch.no_grad():
            self.weight.copy_(torch.cat([p.weight for p in parts]))
            if self.bias is not None:
                self.bias.copy_(torch.cat(biases))
        self.requires_grad_(False)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' outputs, as views of the one output."""
        return self(x).split(self.sizes, dim=-1)


class ProjectionStacks(nn.Module):
    """A module with projections that read the same input. `STACKS` names each stack and its
    parts in output order. The parts keep the checkpoint's names and serve training;
    `stack_projections` replaces them with one `StackedLinear` under the stack's name
    (inference only), and `project` runs whichever of the two the module holds."""

    STACKS: ClassVar[dict[str, tuple[str, ...]]]

    def stack_projections(self) -> None:
        for stack, parts in self.STACKS.items():
            self.add_module(stack, StackedLinear([cast(Linear, self.get_submodule(p)) for p in parts]))
            for p in parts:
                delattr(self, p)

    def stacked(self, stack: str) -> StackedLinear | None:
        """The stack's one `StackedLinear`, once `stack_projections` made it."""
        fused = self._modules.get(stack)
        return fused if isinstance(fused, StackedLinear) else None

    def project(self, stack: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of the stack's parts, in `STACKS` order."""
        fused = self.stacked(stack)
        if fused is not None:
            return fused.split(x)
        return tuple(self.get_submodule(p)(x) for p in self.STACKS[stack])


def stack_projections(model: nn.Module) -> None:
    """Stack the projections of every module that can (see `ProjectionStacks`); called once the
    weights are loaded, before `pack_linears`."""
    for module in list(model.modules()):
        if isinstance(module, ProjectionStacks):
            module.stack_projections()


def pack_linears(model: nn.Module) -> None:
    """Pack every fp32 CPU `Linear` of an inference model (see `Linear`); a no-op where oneDNN
    is missing or the weights are not fp32 on the CPU. After this the model serves inference
    only: its packed layers have no gradients and cannot change dtype or device."""
    if not torch.backends.mkldnn.is_available():
        return
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        weight = module.weight if isinstance(module, Linear) else None
        if weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
            module.pack(keep_weight=uses[id(weight)] > 1)


def collapse_panels(model: nn.Module) -> int:
    """Move the panels the few-row kernel streams onto huge pages (kernels/cpu/huge_pages.py);
    the bytes moved, 0 where the kernel gives none."""
    return sum(
        collapse(module.panels)
        for module in model.modules()
        if isinstance(module, Linear) and module.panels is not None
    )


def panel_fallbacks(model: nn.Module) -> list[str]:
    """The packed Linears that panel_linear does not read, their buffers not the checked layout
    (oneDNN runs them at every row count), for the worker's start-up log; none where the
    installed choice runs no panel_linear."""
    if not cpu_kernels.installed().panel_rows:
        return []
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.packed is not None and module.panels is None
    ]


class RMSNorm(nn.Module):
    """RMS norm computed in fp32.

    `weight_in_fp32` picks where the weight multiplies: NemotronH multiplies before casting
    back (as its reference does), Llama-family models (Qwen3) after. Matching that keeps
    bf16 outputs bit-compatible with transformers.
    """

    def __init__(self, size: int, eps: float, weight_in_fp32: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            return _rms_norm_fp32(x, self.weight, self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * self._normalized_fp32(x)).to(dtype)
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without the weight, in x's dtype: `forward` is `weight * normalize(x)` (bit for
        bit, where the weight multiplies after the cast), so norms of equal size and eps can
        normalise one tensor together and apply their weights as one stacked weight."""
        if x.dtype == torch.float32:
            return _rms_norm_fp32(x, None, self.eps)
        return self._normalized_fp32(x).to(x.dtype)

    def _normalized_fp32(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`F.rms_norm` on fp32: the C++ kernel on a CPU (one pass; torch's CPU op is seven calls
    and ~30 us on a single row, docs/design.md §13), torch's op elsewhere and in training."""
    if cpu_kernels.usable(x) and (weight is None or cpu_kernels.usable(weight)):
        return cpu_kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: gate with silu(z), then RMS-normalise per group.

    A group wider than this module (`group_size > size`) spans the heads of every
    tensor-parallel rank: the mean of squares is then summed across the ranks."""

    def __init__(self, size: int, group_size: int, eps: float, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self._on_kernel(x, gate):
            return cpu_kernels.gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)
        h = x.float() * F.silu(gate.float())
        if self.group_size <= h.shape[-1]:
            # One op instead of five passes over the hybrid's widest activations, the same
            # arithmetic: this norm was a tenth of a prefill.
            normed = _rms_norm_fp32(h.view(*h.shape[:-1], -1, self.group_size), None, self.eps)
        else:
            g = h[..., None, :]
            mean = self.tp.all_reduce(g.pow(2).sum(-1, keepdim=True)) / self.group_size
            normed = g * torch.rsqrt(mean + self.eps)
        return self.weight * normed.view(h.shape).to(dtype)

    def _on_kernel(self, x: torch.Tensor, gate: torch.Tensor) -> bool:
        """fp32 [rows, D] on a CPU, groups within this rank's D (no all-reduce)."""
        return (
            x.dim() == 2
            and x.shape[-1] % self.group_size == 0
            and x.dtype == gate.dtype == self.weight.dtype == torch.float32
            and x.stride(-1) == gate.stride(-1) == 1
            and cpu_kernels.usable(x, gate, self.weight)
        )


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2; in place on x where no gradient is recorded (x is then a projection's fresh
    output): a prefill's MLP activations are megabytes, and each pass over them costs."""
    if torch.is_grad_enabled():
        return torch.square(F.relu(x))
    return x.relu_().square_()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the product taken in place on silu's output where no gradient is
    recorded: one pass and one allocation fewer over a prefill's widest activation."""
    if torch.is_grad_enabled():
        return F.silu(gate) * up
    return F.silu(gate).mul_(up)


class Rotary(nn.Module):
    """Default (unscaled) rotary position embedding, rotate-half layout.

    The frequencies are not a buffer: casting the model to bf16 would round them. Every layer
    of a step rotates by the same positions tensor, so the cos/sin table of the last one seen
    is kept (with that tensor: its identity cannot be reused while held) and shared by all
    layers; recomputing it was ~70 us for each of q and k in every layer of a decode step.
    The table's sin carries rotate-half's sign (-sin on the first half), so the rotation is
    `x * cos + roll(x) * sin`: three calls fewer than negating and concatenating the halves
    (20 -> 10 us a call at batch 1), bit for bit the same (a sign flip is exact)."""

    _last: tuple[torch.Tensor, tuple[int, float, torch.dtype], torch.Tensor, torch.Tensor] | None = None

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def _table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.head_dim, self.theta, dtype)
        last = Rotary._last  # read once: another thread's forward may replace it meanwhile
        if last is not None and last[0] is positions and last[1] == key:
            return last[2], last[3]
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device).float() / self.head_dim
        freqs = positions[..., None].float() * (1.0 / (self.theta**exponents))
        cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[..., None, :]
        sin = freqs.sin()
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)[..., None, :]
        Rotary._last = (positions, key, cos, sin)
        return cos, sin

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [N, head_dim] for flat positions [N], as `forward` multiplies by
        them (views of the shared table), for a kernel that rotates in its own pass."""
        cos, signed_sin = self._table(positions, dtype)
        return cos.view(-1, self.head_dim), signed_sin.view(-1, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, head_dim]; positions broadcastable to [..., T]."""
        cos, signed_sin = self._table(positions, x.dtype)
        return x * cos + x.roll(self.head_dim // 2, -1) * signed_sin
