"""Linears packed for oneDNN compute what the plain weight does, release it unless it is
shared, and leave models that cannot be packed alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models.layers import Linear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.proj = Linear(16, 24, bias=True)
        self.head = Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 33, 300])
def test_packed_output_matches_the_plain_weight(rows):
    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(rows, 96)
    pack_linears(layer)
    assert layer.packed is not None
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_packing_reads_strided_and_batched_inputs():
    layer = Linear(32, 8, bias=False)
    weight = layer.weight.detach().clone()
    pack_linears(layer)
    x = torch.randn(2, 5, 64)[..., ::2]  # [2, 5, 32], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_plain_weight_is_released_unless_another_module_shares_it():
    model = _Tied()
    embed = model.embed.weight.detach().clone()
    pack_linears(model)
    assert model.proj.weight.numel() == 0
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, embed)
    assert torch.equal(model.head.packed.to_dense(), embed)


def test_half_precision_linears_stay_as_they_are():
    model = _Tied().to(torch.bfloat16)
    pack_linears(model)
    assert model.proj.packed is None and model.head.packed is None
    assert model.proj.weight.shape == (24, 16)
