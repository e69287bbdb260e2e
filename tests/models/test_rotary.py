"""The rotary table shared between layers is reused only for the very positions tensor, width,
base and dtype it was made for."""

from __future__ import annotations

import torch

from models.layers import Rotary


def _by_hand(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).double() / dim)
    angles = positions[:, None].double() * inv  # [T, dim / 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = x[..., : dim // 2].double(), x[..., dim // 2 :].double()
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def test_layers_of_other_widths_bases_dtypes_and_positions_get_their_own_table():
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 17, 200])
    other = torch.tensor([5, 6, 7, 8])
    x64, x32 = torch.randn(4, 2, 64), torch.randn(4, 2, 32)
    calls = [
        (Rotary(64, 1e4), x64, positions),
        (Rotary(32, 1e4), x32, positions),  # same positions, narrower
        (Rotary(32, 1e6), x32, positions),  # same positions and width, another base
        (Rotary(32, 1e6), x32.bfloat16(), positions),
        (Rotary(32, 1e6), x32, other),
        (Rotary(64, 1e4), x64, positions),  # back to the first: recomputed, not stale
    ]
    for rotary, x, pos in calls * 2:
        got = rotary(x, pos)
        assert got.dtype == x.dtype
        tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), _by_hand(x.float(), pos, rotary.theta), rtol=tol, atol=tol)
