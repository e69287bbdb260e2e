"""The chunked SSD scan equals Mamba2's recurrence taken one token at a time in float64, with
decays strong enough that a chunk's log-decays sum to hundreds (where fp32 differences of long
running sums would lose digits, and exp() of the masked entries would underflow or overflow)."""

from __future__ import annotations

import pytest
import torch

from models.mamba import chunk_scan


def _recurrence(x, dt, a, b, c, d, initial):
    """y_t = C_t . S_t + D x_t with S_t = exp(dt_t a) S_{t-1} + dt_t x_t B_t^T, in float64."""
    x, dt, a, b, c, d = (t.double() for t in (x, dt, a, b, c, d))
    bsz, length, heads, pdim = x.shape
    rep = heads // b.shape[2]
    b, c = b.repeat_interleave(rep, dim=2), c.repeat_interleave(rep, dim=2)  # [B, T, H, N]
    state = torch.zeros(bsz, heads, pdim, b.shape[-1], dtype=torch.float64)
    if initial is not None:
        state = initial.double().clone()
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * a)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]) + x[:, t] * d[:, None])
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize(
    ("length", "chunk", "with_state", "dt_scale"),
    [
        (32, 32, False, 0.1),  # a fresh prompt within one chunk
        (32, 32, False, 4.0),  # ... whose log-decays sum to hundreds
        (45, 16, True, 0.5),  # several chunks, the last one padded, on top of a state
        (50, 16, False, 4.0),
        (128, 128, False, 2.0),
    ],
)
def test_chunk_scan_equals_the_token_by_token_recurrence(length, chunk, with_state, dt_scale):
    gen = torch.Generator().manual_seed(length)
    bsz, heads, pdim, nstate, groups = 2, 4, 8, 6, 2
    x = torch.randn(bsz, length, heads, pdim, generator=gen)
    dt = torch.rand(bsz, length, heads, generator=gen) * dt_scale
    a = -torch.rand(heads, generator=gen) * 8 - 0.5
    b = torch.randn(bsz, length, groups, nstate, generator=gen)
    c = torch.randn(bsz, length, groups, nstate, generator=gen)
    d = torch.randn(heads, generator=gen)
    initial = torch.randn(bsz, heads, pdim, nstate, generator=gen) if with_state else None
    y, final = chunk_scan(x, dt, a, b, c, d, chunk, initial)
    want_y, want_state = _recurrence(x, dt, a, b, c, d, initial)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    torch.testing.assert_close(y.double(), want_y, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final.double(), want_state, rtol=2e-5, atol=2e-5)
