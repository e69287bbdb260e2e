"""The few-row matmul reads oneDNN's packed buffer in place only where that buffer is checked to
hold the weight, and a packed Linear takes it for a decode step's rows and oneDNN for more."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from kernels.cpu.onednn_panels import panels_of
from models.layers import Linear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize(("out_features", "in_features"), [(96, 40), (100, 77), (24, 512), (3072, 512)])
def test_the_panels_are_the_packed_weight_where_the_layout_is_one_the_kernel_reads(out_features, in_features):
    weight = torch.randn(out_features, in_features)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    panels = panels_of(packed, weight)
    if panels is None:
        pytest.skip("oneDNN chose a layout other than column blocks on this CPU")
    blocks, kp, nb = panels.shape
    assert kp >= in_features and (blocks - 1) * nb < out_features <= blocks * nb
    plain = panels[:, :in_features].permute(0, 2, 1).reshape(-1, in_features)[:out_features]
    assert torch.equal(plain, weight)
    assert panels.data_ptr() == torch.ops.mkldnn.data_ptr(packed)  # read in place, not copied


def test_a_buffer_that_does_not_hold_the_weight_is_not_read():
    weight = torch.randn(96, 40)
    other = weight.clone()
    other[95, 39] += 1.0  # one element differs, in the last block
    assert panels_of(torch.ops.mkldnn._reorder_linear_weight(other, 32), weight) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 32])
def test_a_packed_linear_takes_the_panel_kernel_for_a_decode_steps_rows(rows, monkeypatch):
    layer = Linear(64, 200, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    pack_linears(layer)
    if layer.panels is None:
        pytest.skip("oneDNN chose a layout other than column blocks on this CPU")
    calls = []
    kernel = cpu_kernels.panel_linear
    monkeypatch.setattr(cpu_kernels, "panel_linear", lambda *args: calls.append(1) or kernel(*args))
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert layer.panel_rows == cpu_kernels.panel_row_limit()
    assert len(calls) == (1 if rows <= layer.panel_rows else 0)


def test_without_the_cpu_kernels_a_packed_linear_stays_with_onednn(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors: False)
    layer = Linear(64, 200, bias=False)
    weight = layer.weight.detach().clone()
    pack_linears(layer)
    assert layer.panels is None and layer.packed is not None
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
