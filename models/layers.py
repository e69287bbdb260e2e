"""Small building blocks shared by the model definitions."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from models.tensor_parallel import SINGLE, TPGroup

_ONEDNN_LINEAR = torch.backends.mkldnn.is_available()
_ONEDNN_MIN_ROWS = 8


class Linear(nn.Linear):
    """`nn.Linear` whose fp32 inference on CPU runs oneDNN's matmul from 8 rows up. torch
    sends fp32 CPU matmuls to MKL, whose kernels on this machine's AMD EPYC ran 1.2-1.45x
    slower than oneDNN's (an AVX-512 JIT that does not depend on the CPU's vendor) at 8-256
    rows with the weights out of cache; below 8 rows the matmul streams the weights and both
    are as fast. With gradients, half precision or on other devices it is `nn.Linear` as is
    (oneDNN's op has no autograd)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            _ONEDNN_LINEAR
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.numel() >= _ONEDNN_MIN_ROWS * x.shape[-1]
            and not torch.is_grad_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


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
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)


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
        h = x.float() * F.silu(gate.float())
        if self.group_size > h.shape[-1]:
            g = h[..., None, :]
            mean = self.tp.all_reduce(g.pow(2).sum(-1, keepdim=True)) / self.group_size
        else:
            g = h.view(*h.shape[:-1], -1, self.group_size)
            mean = g.pow(2).mean(-1, keepdim=True)
        g = g * torch.rsqrt(mean + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class Rotary(nn.Module):
    """Default (unscaled) rotary position embedding, rotate-half layout.

    The frequencies are not a buffer: casting the model to bf16 would round them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, head_dim]; positions broadcastable to [..., T]."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim))
        freqs = positions[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[..., None, :]
        sin = emb.sin().to(x.dtype)[..., None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
