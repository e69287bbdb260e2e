"""Gated DeltaNet (Qwen3.5's linear attention) with its state kept in cache slots.

Per request the layer keeps a conv state (the last `kernel - 1` inputs of the causal
depthwise convolution over q, k and v) and a recurrent state `[v_heads, k_dim, v_dim]`,
both fp32, in the page its state group ("mamba" kind) allocated. As with Mamba2 the page is
never zeroed (docs/design.md §1): a request's first chunk starts from zeros *without reading*
its slot, and every step overwrites the slot. Prefill chunks run the chunked delta rule per
request; decode tokens run one vectorised recurrent step.

The update per token, with decay `a = exp(g)` and write strength `beta`:
`S = a * S;  S += k (beta * (v - S^T k))^T;  out = S^T q`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from models.batch import ForwardBatch
from models.config import GatedDeltaNetSpec
from models.layers import Linear, ProjectionStacks

CHUNK = 64


def unit_lower_inverse(t: torch.Tensor) -> torch.Tensor:
    """Inverse of unit lower-triangular matrices [..., L, L] (L a power of two), built bottom
    up from 1x1 blocks: inv([[A, 0], [C, B]]) = [[A', 0], [-B' C A', B']]. A few batched
    matmuls instead of one LAPACK triangular solve per matrix, which on CPU cost ten times
    more than the whole chunk's other work."""
    length = t.shape[-1]
    inv = torch.ones(*t.shape[:-2], length, 1, 1, dtype=t.dtype, device=t.device)
    size = 1
    while size < length:
        n = length // (2 * size)
        pairs = inv.unflatten(-3, (n, 2))
        upper, lower = pairs[..., 0, :, :], pairs[..., 1, :, :]
        blocks = t.unflatten(-2, (n, 2, size)).unflatten(-1, (n, 2, size))
        below = torch.diagonal(blocks, dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)
        inv = torch.cat(
            [torch.cat([upper, torch.zeros_like(upper)], -1), torch.cat([-(lower @ below @ upper), lower], -1)], -2
        )
        size *= 2
    return inv[..., 0, :, :]


class UnitLowerSolve(torch.autograd.Function):
    """x = T^-1 r for unit lower-triangular T (only its strictly lower part is read). The
    backward uses the forward's inverse: dr = T^-T dx, dT = -(dr x^T), strictly lower."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        inv = unit_lower_inverse(t.detach())
        x = inv @ r
        ctx.save_for_backward(inv, x)
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv, x = ctx.saved_tensors
        grad_r = inv.transpose(-1, -2) @ grad
        return -(grad_r @ x.transpose(-1, -2)).tril(-1), grad_r


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor | None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole chunks, in fp32. q, k: [B, T, H, K] (normalised, q
    scaled); v: [B, T, H, V]; g (log decay), beta: [B, T, H]; initial: [B, H, K, V] or None.
    Returns out [B, T, H, V] and the final state [B, H, K, V].

    Within a chunk the sequential updates are one triangular solve (the WY form): each
    token's write `d_t` corrects what the state before it already predicts for `k_t`, and
    those predictions depend only on earlier writes of the same chunk and the chunk's
    starting state. Padding gets g = 0 and beta = 0: it neither decays nor writes."""
    bsz, length, heads, kdim = k.shape
    pad = (chunk - length % chunk) % chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, C, L, ...]
        t = F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, pad)).transpose(1, 2)
        return t.reshape(bsz, heads, -1, chunk, *t.shape[3:])

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    cum = g.cumsum(-1)  # [B, H, C, L] log decay from the chunk start to each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    # (I + strictly lower(beta_i k_i.k_j decay_ij)) d = beta v - beta k decay S0
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    solved = UnitLowerSolve.apply(system, torch.cat([v * beta[..., None], kb * cum.exp()[..., None]], -1))
    writes, reads = solved.split([v.shape[-1], kdim], -1)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = initial.float() if initial is not None else q.new_zeros((bsz, heads, kdim, v.shape[-1]))
    out = torch.empty_like(v)
    for c in range(q.shape[2]):
        d = writes[:, :, c] - reads[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ d
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ d
    out = out.reshape(bsz, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. q, k: [R, H, K]; v: [R, H, V]; g, beta: [R, H]; state:
    [R, H, K, V] fp32. Returns out [R, H, V] and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)
    state = state + k[..., None] * ((v - predicted) * beta[..., None])[..., None, :]
    return (state * q[..., None]).sum(-2), state


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class NormThenGate(nn.Module):
    """The output norm of Gated DeltaNet: RMS-normalise each head, scale, then gate with
    silu(z) (Mamba2's norm gates first)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(ProjectionStacks):
    """The input projections, one matmul once stacked, give the conv's input [q | k | v], the
    output gate z, and b, a (per value head)."""

    STACKS: ClassVar[dict[str, tuple[str, ...]]] = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}

    def __init__(self, hidden_size: int, spec: GatedDeltaNetSpec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.in_proj_qkv = Linear(hidden_size, spec.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, spec.value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, spec.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, spec.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            spec.conv_dim,
            spec.conv_dim,
            spec.conv_kernel,
            groups=spec.conv_dim,
            bias=False,
            padding=spec.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(spec.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(spec.num_v_heads).uniform_(0.01, 16).log())
        self.norm = NormThenGate(spec.head_v_dim, eps)
        self.out_proj = Linear(spec.value_dim, hidden_size, bias=False)

    def _heads(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv output [..., conv_dim] -> q, k [..., Hv, K] (unit length, q scaled, key heads
        repeated over their value heads), v [..., Hv, V], and g, beta [..., Hv], all fp32."""
        s = self.spec
        q, k, v = mixed.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        rep = s.num_v_heads // s.num_k_heads
        q = l2norm(q.unflatten(-1, (s.num_k_heads, s.head_k_dim))).repeat_interleave(rep, dim=-2)
        k = l2norm(k.unflatten(-1, (s.num_k_heads, s.head_k_dim))).repeat_interleave(rep, dim=-2)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q * s.head_k_dim**-0.5, k, v.unflatten(-1, (s.num_v_heads, s.head_v_dim)), g, b.float().sigmoid()

    def _conv(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + silu over [B, T, C] continuing from state [B, C, K-1]."""
        keep = self.spec.conv_kernel - 1
        seq = x.transpose(1, 2)
        prev = state.to(seq.dtype) if state is not None else seq.new_zeros((*seq.shape[:2], keep))
        full = torch.cat([prev, seq], dim=-1)
        out = F.conv1d(full, self.conv1d.weight, groups=self.spec.conv_dim)
        return F.silu(out).transpose(1, 2), full[..., -keep:]

    def _finish(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out: [..., Hv, V] fp32 -> [..., hidden]."""
        gated = self.norm(out.to(dtype), z.unflatten(-1, (self.spec.num_v_heads, self.spec.head_v_dim)))
        return self.out_proj(gated.flatten(-2))

    def forward_dense(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] from an empty state (training and references)."""
        projected, z, b, a = self.project("in_proj", h)
        mixed, _ = self._conv(projected, None)
        q, k, v, g, beta = self._heads(mixed, a, b)
        out, _ = chunk_delta_rule(q, k, v, g, beta, None)
        return self._finish(out, z, h.dtype)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        conv_cache: torch.Tensor,
        state_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """h: [N, hidden] flat tokens; caches: [num_blocks, ...] state views."""
        s = self.spec
        mixed, z, b, a = self.project("in_proj", h)
        out = h.new_empty((h.shape[0], s.num_v_heads, s.head_v_dim), dtype=torch.float)
        decode = batch.decode_reqs
        if decode:
            self._decode_step(decode, batch, mixed, a, b, conv_cache, state_cache, slots, out)
        for r in batch.chunk_reqs:
            lo, hi = batch.query_start[r], batch.query_start[r + 1]
            slot = slots[r]
            fresh = batch.num_computed[r] == 0
            conv_out, conv_state = self._conv(mixed[None, lo:hi], None if fresh else conv_cache[slot][None])
            q, k, v, g, beta = self._heads(conv_out, a[None, lo:hi], b[None, lo:hi])
            y, final = chunk_delta_rule(q, k, v, g, beta, None if fresh else state_cache[slot][None])
            conv_cache[slot] = conv_state[0].to(conv_cache.dtype)
            state_cache[slot] = final[0]
            out[lo:hi] = y[0]
        return self._finish(out, z, h.dtype)

    def _decode_step(
        self,
        reqs: tuple[int, ...],
        batch: ForwardBatch,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_cache: torch.Tensor,
        state_cache: torch.Tensor,
        slots: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        idx = torch.tensor([batch.query_start[r] for r in reqs], device=mixed.device)
        s = slots[torch.tensor(reqs, device=slots.device)]
        if mixed.dtype == torch.float32 and cpu_kernels.usable(conv_cache, mixed):
            conv_out = cpu_kernels.causal_conv(conv_cache, s, mixed[idx], self.conv1d.weight, None)
        else:
            window = torch.cat([conv_cache[s].to(mixed.dtype), mixed[idx][..., None]], dim=-1)  # [R, C, K]
            conv_cache[s] = window[..., 1:].to(conv_cache.dtype)
            conv_out = F.silu((window * self.conv1d.weight[:, 0]).sum(-1))
        q, k, v, g, beta = self._heads(conv_out, a[idx], b[idx])
        y, state = recurrent_step(q, k, v, g, beta, state_cache[s])
        state_cache[s] = state
        out[idx] = y
