"""Mamba2 mixer with its state kept in cache slots.

A request's recurrent state is a conv state (the last `conv_kernel - 1` inputs of the
causal convolution) and an SSM state `[heads, head_dim, state]`, both fp32, in the page
its Mamba group allocated. Mamba pages are never zeroed (docs/design.md §1): the first chunk of
a request starts from zeros *without reading* its slot, and every step overwrites the slot.
On a CPU the C++ kernels run every request of a step, prefill chunk or decode token, as one
convolution and one recurrence (docs/design.md §13). Elsewhere prefill chunks run the chunked
SSD scan per request and decode tokens run one vectorised step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from models.batch import ForwardBatch
from models.config import MambaSpec
from models.layers import GatedRMSNorm, Linear
from models.tensor_parallel import SINGLE, TPGroup

# exp() of an argument below about -87 underflows fp32 to a subnormal or zero, and torch's CPU
# exp takes a slow path for those and for -inf (measured 2-10x over a [16, 128, 128] decay
# matrix). Decays are clamped here instead: exp(-80) ~ 2e-35 is a weight no sum can see.
_MIN_LOG_DECAY = -80.0


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """[..., T] log-decays (<= 0) -> [..., T, T] with out[i, j] = exp(sum(log_decay[j+1..i]))
    for j <= i (the decay from step j to step i), 0 above the diagonal. The sums are taken as
    differences of float64 running sums: as exact as summing each segment, without a
    cumulative sum over [T, T]. Above the diagonal the difference is >= 0; it is clamped to 0
    and zeroed after the exp, so nothing overflows either."""
    cum = torch.cumsum(log_decay.double(), dim=-1)
    seg = (cum[..., :, None] - cum[..., None, :]).to(log_decay.dtype).clamp_(_MIN_LOG_DECAY, 0.0)
    return seg.exp_().tril_()  # tril_: ~20x faster here than masked_fill_ with a [T, T] mask


def chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    chunk: int,
    initial: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan in fp32. x: [B, T, H, P]; dt: [B, T, H] (already softplus'd and
    clamped); a, d: [H]; b, c: [B, T, G, N], one per group of H / G consecutive heads;
    initial: [B, H, P, N] or None. Returns y [B, T, H, P] and the final state [B, H, P, N].
    Padding positions get dt = 0, which neither decays nor feeds the state.

    B and C are shared by the heads of a group, so every product with them is taken once per
    group and the heads enter as a second index (h = g * R + r), never as copies of B and C."""
    bsz, length, heads, pdim = x.shape
    groups = b.shape[2]
    rep = heads // groups
    pad = (chunk - length % chunk) % chunk
    x, dt, b, c = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, b, c))
    residual = x * d[:, None]
    xd = x * dt[..., None]
    adt = a * dt

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(bsz, -1, chunk, *t.shape[2:])

    xd, adt, b, c = chunks(xd), chunks(adt), chunks(b), chunks(c)
    num_chunks = xd.shape[1]
    adt = adt.permute(0, 3, 1, 2)  # [B, H, C, L]
    cum = torch.cumsum(adt, dim=-1)
    decay = _decay(adt)  # [B, H, C, L, S]
    scores = torch.einsum("bclgn,bcsgn->bgcls", c, b)  # [B, G, C, L, S]
    weights = decay.view(bsz, groups, rep, num_chunks, chunk, chunk) * scores[:, :, None]
    y_diag = torch.einsum("bgrcls,bcsgrp->bclgrp", weights, xd.view(*xd.shape[:3], groups, rep, pdim))
    decay_states = torch.exp(cum[..., -1:] - cum)  # [B, H, C, L]
    weighted = xd * decay_states.permute(0, 2, 3, 1)[..., None]  # [B, C, L, H, P]
    states = torch.einsum("bclgn,bclgrp->bcgrpn", b, weighted.view(*weighted.shape[:3], groups, rep, pdim))
    states = states.reshape(bsz, num_chunks, heads, pdim, -1)
    y_diag = y_diag.reshape(bsz, num_chunks, chunk, heads, pdim)
    if initial is None and num_chunks == 1:  # a fresh prompt within one chunk: no state flows in
        return (y_diag.reshape(bsz, -1, heads, pdim) + residual)[:, :length], states[:, 0]
    start = initial[:, None] if initial is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([start, states], dim=1)
    decay_chunk = _decay(F.pad(cum[..., -1], (1, 0)))  # [B, H, C+1, C+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final = states[:, :-1], states[:, -1]
    grouped = states.reshape(bsz, num_chunks, groups, rep, pdim, -1)
    y_off = torch.einsum("bclgn,bcgrpn->bclgrp", c, grouped).reshape(bsz, num_chunks, chunk, heads, pdim)
    y_off = y_off * torch.exp(cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(bsz, -1, heads, pdim) + residual
    return y[:, :length], final


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, spec: MambaSpec, eps: float, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        inter = spec.intermediate_size
        self.in_proj = Linear(hidden_size, inter + spec.conv_dim + spec.num_heads, bias=bias)
        self.conv1d = nn.Conv1d(
            spec.conv_dim,
            spec.conv_dim,
            spec.conv_kernel,
            groups=spec.conv_dim,
            bias=spec.use_conv_bias,
            padding=spec.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(spec.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, spec.num_heads + 1, dtype=torch.float)))
        self.D = nn.Parameter(torch.ones(spec.num_heads))
        self.norm = GatedRMSNorm(inter, spec.group_size, eps, tp)
        self.out_proj = Linear(inter, hidden_size, bias=bias)

    def _split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        return self.in_proj(h).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.spec.time_step_min)

    def _ssm_inputs(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split conv output into x [.., H, P] and B, C per group [.., G, N]."""
        s = self.spec
        x, b, c = xbc.split([s.intermediate_size, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        b = b.unflatten(-1, (s.n_groups, s.state_size)).float()
        c = c.unflatten(-1, (s.n_groups, s.state_size)).float()
        return x.unflatten(-1, (s.num_heads, s.head_dim)).float(), b, c

    def _conv(self, xbc: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv over [B, T, C] continuing from state [B, C, K-1]."""
        k = self.spec.conv_kernel
        seq = xbc.transpose(1, 2)
        prev = state.to(seq.dtype) if state is not None else seq.new_zeros((*seq.shape[:2], k - 1))
        full = torch.cat([prev, seq], dim=-1)
        out = F.conv1d(full, self.conv1d.weight, self.conv1d.bias, groups=self.spec.conv_dim)
        return F.silu(out).transpose(1, 2), full[..., -(k - 1) :]

    def _finish(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = self.norm(y.flatten(-2).to(dtype), gate)
        return self.out_proj(y)

    def forward_dense(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] from an empty state (training and references)."""
        gate, xbc, dt = self._split(h)
        xbc, _ = self._conv(xbc, None)
        x, b, c = self._ssm_inputs(xbc)
        a = -torch.exp(self.A_log.float())
        y, _ = chunk_scan(x, self._dt(dt), a, b, c, self.D.float(), self.spec.chunk_size, None)
        return self._finish(y, gate, h.dtype)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """h: [N, hidden] flat tokens; caches: [num_blocks, ...] state views."""
        gate, xbc, dt = self._split(h)
        a = -torch.exp(self.A_log.float())
        if xbc.dtype == torch.float32 and cpu_kernels.usable(ssm_cache, xbc):
            # Every request, prefill chunk or decode token, in one call per kernel.
            spans = batch.state_spans
            x, b, c = self._ssm_inputs(
                cpu_kernels.causal_conv(conv_cache, slots, xbc, self.conv1d.weight, self.conv1d.bias, spans)
            )
            params = (self.dt_bias, a, self.D, self.spec.time_step_min)
            return self._finish(cpu_kernels.mamba_ssm(ssm_cache, slots, x, dt, params, b, c, spans), gate, h.dtype)
        y = h.new_empty((h.shape[0], self.spec.num_heads, self.spec.head_dim), dtype=torch.float)
        decode = batch.decode_reqs
        if decode:
            self._decode_step(decode, batch, xbc, dt, a, conv_cache, ssm_cache, slots, y)
        for r in batch.chunk_reqs:
            lo, hi = batch.query_start[r], batch.query_start[r + 1]
            slot = slots[r]
            fresh = batch.num_computed[r] == 0
            out, conv_state = self._conv(xbc[None, lo:hi], None if fresh else conv_cache[slot][None])
            x, b, c = self._ssm_inputs(out)
            init = None if fresh else ssm_cache[slot][None]
            yr, final = chunk_scan(x, self._dt(dt[None, lo:hi]), a, b, c, self.D.float(), self.spec.chunk_size, init)
            conv_cache[slot] = conv_state[0].to(conv_cache.dtype)
            ssm_cache[slot] = final[0]
            y[lo:hi] = yr[0]
        return self._finish(y, gate, h.dtype)

    def _decode_step(
        self,
        reqs: tuple[int, ...],
        batch: ForwardBatch,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
        slots: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        if len(reqs) == xbc.shape[0]:  # a pure decode step: every token is its request's one
            idx: torch.Tensor | slice = slice(None)
            s = slots
        else:
            idx = torch.tensor([batch.query_start[r] for r in reqs], device=xbc.device)
            s = slots[torch.tensor(reqs, device=slots.device)]
        # index_select / index_copy_ over the page-strided state views: advanced indexing
        # (`conv_cache[s]`, `conv_cache[s] = ...`) took 1.2-2x as long.
        window = torch.cat([conv_cache.index_select(0, s).to(xbc.dtype), xbc[idx][..., None]], dim=-1)  # [R, C, K]
        conv_cache.index_copy_(0, s, window[..., 1:].to(conv_cache.dtype))
        out = (window * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        x, b, c = self._ssm_inputs(F.silu(out))
        rep = self.spec.num_heads // self.spec.n_groups
        b, c = b.repeat_interleave(rep, dim=-2), c.repeat_interleave(rep, dim=-2)  # per head, [R, H, N]
        step = self._dt(dt[idx])  # [R, H]
        y[idx] = ssm_step(ssm_cache, s, torch.exp(step * a), step[..., None] * x, b, c) + x * self.D.float()[:, None]


def ssm_step(
    ssm_cache: torch.Tensor,
    slots: torch.Tensor,
    decay: torch.Tensor,
    dx: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """One token of the SSM recurrence for each request, updating its state slot:
    `S = decay * S + dx b^T; y = S c`. ssm_cache: [blocks, H, P, N]; slots: [R];
    decay: [R, H]; dx: [R, H, P]; b, c: [R, H, N]. Returns y [R, H, P]. The torch path (a GPU,
    or a CPU without the C++ kernels, `cpu_kernels.mamba_ssm`).

    y is computed as `c^T S^T` (a row times a matrix): batched matrix-vector products with
    the vector on the right run several times slower on CPU."""
    decay, dx, b, c = decay[..., None, None], dx[..., None], b[..., None, :], c[..., None, :]
    state = ssm_cache[slots]  # one gathered copy, updated in place, written back once
    state.mul_(decay).addcmul_(dx, b)
    ssm_cache.index_copy_(0, slots, state)
    return torch.matmul(c, state.transpose(-1, -2))[:, :, 0]
