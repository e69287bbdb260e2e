"""The few-row matmul reads oneDNN's packed buffer in place only where that buffer is checked to
hold the weight, and a packed Linear takes it for a decode step's rows and oneDNN for more.

oneDNN picks the layout per CPU (kernels/cpu/onednn_panels.py lists what it picks per
instruction set). On a CPU whose documented layout is the panels, a buffer that cannot be read
as panels fails here, loudly: a torch upgrade must not lose the fast path in silence. Where the
documented layout is another (x86-64 below AVX2: the weight unblocked), the Linear is
shown to stay with oneDNN and to compute the same, on every x86-64 host by capping oneDNN below
AVX2 in a child process."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kernels.cpu import ops as cpu_kernels
from kernels.cpu.onednn_panels import documented_layout, layout_of, panels_of
from models.layers import Linear, pack_linears, panel_fallbacks
from tests.kernels.cpu.vector_widths import VECTOR_BITS

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

# (out, in): blocks left part-filled, k not a multiple of 16, one block, 129 outputs (16-column
# blocks with AVX2), and a model's shape.
SHAPES = [(96, 40), (100, 77), (24, 512), (129, 40), (3072, 512)]


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def _plain(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out, in] weight the panels hold."""
    return panels[:, :in_features].permute(0, 2, 1).reshape(-1, in_features)[:out_features]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_this_cpus_packed_weight_is_the_layout_documented_for_it(out_features, in_features):
    expected = documented_layout()
    if expected is None:
        pytest.fail(
            f"no oneDNN weight layout is documented for a {platform.machine()} CPU: read what "
            "_reorder_linear_weight gives it and list it in kernels/cpu/onednn_panels.py"
        )
    weight = torch.randn(out_features, in_features)
    packed = _packed(weight)
    got = layout_of(packed, weight)
    assert got == expected, (
        f"oneDNN packed a {out_features}x{in_features} weight as {got or 'an unknown layout'} on this CPU, where "
        f"kernels/cpu/onednn_panels.py documents {expected}: every Linear would leave panel_linear for oneDNN"
    )
    if expected == "panels":
        panels = panels_of(packed, weight)
        assert panels is not None
        blocks, kp, nb = panels.shape
        assert kp >= in_features and (blocks - 1) * nb < out_features <= blocks * nb
        assert torch.equal(_plain(panels, out_features, in_features), weight)
        assert panels.data_ptr() == torch.ops.mkldnn.data_ptr(packed)  # read in place, not copied


def test_a_buffer_that_does_not_hold_the_weight_is_not_read():
    weight = torch.randn(96, 40)
    other = weight.clone()
    other[95, 39] += 1.0  # one element differs, in the last block
    assert panels_of(_packed(other), weight) is None


def test_the_panels_keep_the_packed_buffer_they_read_alive():
    """The panels read memory oneDNN's tensor owns; with every other reference to that tensor
    gone they still read the weight, and the buffer goes with the last view of them."""
    weight = torch.randn(64, 40)  # one block of 64 columns: panels in every documented layout
    packed = _packed(weight)
    panels = panels_of(packed, weight)
    assert panels is not None
    first_block = panels[0]  # a view of the view holds the buffer as well
    alive = weakref.ref(packed)
    del packed
    gc.collect()
    churn = [torch.full((64 * 48,), float("nan")) for _ in range(256)]  # where freed memory would go
    assert alive() is not None
    assert torch.equal(_plain(panels, 64, 40), weight)
    del panels, churn
    gc.collect()
    assert alive() is not None
    assert torch.equal(first_block[:40].T, weight)
    del first_block
    gc.collect()
    assert alive() is None


def _panel_calls(monkeypatch) -> list[int]:
    """The vector width of each panel_linear call from now on."""
    calls: list[int] = []
    kernel = cpu_kernels.panel_linear
    monkeypatch.setattr(
        cpu_kernels, "panel_linear", lambda x, p, b, n, bits: calls.append(bits) or kernel(x, p, b, n, bits)
    )
    return calls


@pytest.mark.parametrize("bits", VECTOR_BITS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17, 32])
def test_a_packed_linear_takes_the_panel_kernel_for_a_decode_steps_rows(rows, bits, monkeypatch):
    """At either vector width (256 bits: what an AVX2 CPU decides), up to its row limit."""
    if documented_layout() == "plain":
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        why = "this CPU has no AVX2" if "avx2" not in cpu_kernels.cpu_features() else f"oneDNN is capped to {cap}"
        pytest.skip(
            f"{why}: oneDNN lays weights out plain, which the panel kernel does not read "
            "(test_where_onednn_lays_weights_out_plain_a_packed_linear_stays_with_onednn covers it)"
        )
    choice = replace(cpu_kernels.decide(True), vector_bits=bits, panel_rows=cpu_kernels.panel_row_limit(bits))
    with cpu_kernels.using(choice):
        layer = Linear(64, 200, bias=True)
        weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
        pack_linears(layer)
        assert layer.panels is not None, "oneDNN's buffer was not read as panels on this CPU"
        calls = _panel_calls(monkeypatch)
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = layer(x)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == ([bits] if rows <= choice.panel_rows else [])


def test_without_the_cpu_kernels_a_packed_linear_stays_with_onednn(monkeypatch):
    """Packed under the kernels off, it has no panels; packed under them on and run under them
    off (the torch path of a test's model), it leaves its panels alone."""
    off = cpu_kernels.decide(False)
    layers = []
    for packed_under in (off, cpu_kernels.decide(True)):
        with cpu_kernels.using(packed_under):
            layer = Linear(64, 200, bias=False)
            layers.append((layer, layer.weight.detach().clone()))
            pack_linears(layer)
    assert layers[0][0].panels is None and layers[0][0].packed is not None
    calls = _panel_calls(monkeypatch)
    x = torch.randn(1, 64)
    with cpu_kernels.using(off), torch.inference_mode():
        for layer, weight in layers:
            torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == []


def check_the_plain_fallback() -> None:
    """In a process whose oneDNN is capped below AVX2 (the documented plain layout): every
    packed Linear stays with oneDNN at every row count, computes what F.linear does, and the
    start-up line names the layers left to oneDNN."""
    assert documented_layout() == "plain", os.environ.get("ONEDNN_MAX_CPU_ISA")
    model = nn.Sequential(*(Linear(i, o, bias=True) for o, i in SHAPES if o > 64))
    plain = {name: (m.weight.detach().clone(), m.bias.detach().clone()) for name, m in model.named_children()}
    pack_linears(model)
    calls: list[int] = []
    kernel = cpu_kernels.panel_linear
    cpu_kernels.panel_linear = lambda *args: calls.append(1) or kernel(*args)
    for name, layer in model.named_children():
        weight, bias = plain[name]
        assert layout_of(layer.packed, weight) == "plain" and layer.panels is None
        for rows in (1, 2, 8, 32):
            x = torch.randn(rows, layer.in_features)
            with torch.inference_mode():
                torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == []
    assert panel_fallbacks(model) == list(plain)
    line = cpu_kernels.summary(cpu_kernels.installed(), panel_fallbacks(model))
    assert f"{len(plain)} packed layer(s) left to oneDNN (layout not the checked one): 0, 1" in line, line


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA caps x86-64 instruction sets only"
)
def test_where_onednn_lays_weights_out_plain_a_packed_linear_stays_with_onednn():
    """The documented layout of an x86-64 CPU without AVX2, on this one: oneDNN capped to AVX."""
    run = subprocess.run(
        [sys.executable, "-c", f"from {__name__} import check_the_plain_fallback; check_the_plain_fallback()"],
        cwd=Path(cpu_kernels.__file__).resolve().parents[2],
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
