"""Collapsing a weight onto huge pages keeps its contents and its address, and the pages it
reports are huge in the process's own map; a weight smaller than a huge page is left alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernels.cpu.huge_pages import HUGE_PAGE, collapse
from models.layers import Linear, collapse_panels, pack_linears


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            found = re.search(r"^AnonHugePages:\s+(\d+) kB", block, re.M)
            assert found is not None, block
            return int(found.group(1))
    raise AssertionError(f"no mapping holds {address:#x}")


def test_collapse_keeps_the_contents_on_huge_pages():
    t = torch.arange(8 * HUGE_PAGE // 4, dtype=torch.float32)  # 16 MiB: at least 7 whole huge pages
    expected, address = t.clone(), t.data_ptr()
    moved = collapse(t)
    if moved == 0:
        pytest.skip("this kernel gives no huge pages here (THP set to never, Linux before 6.1, or none free)")
    assert moved % HUGE_PAGE == 0 and moved >= 7 * HUGE_PAGE
    assert t.data_ptr() == address and torch.equal(t, expected)
    assert _anon_huge_kb(address) >= moved // 1024


def test_a_tensor_within_one_huge_page_is_left_alone():
    assert collapse(torch.ones(1000)) == 0
    assert collapse(torch.ones(HUGE_PAGE // 4, dtype=torch.float32)[::2]) == 0  # not contiguous


def test_collapsed_panels_compute_what_they_did():
    torch.manual_seed(0)
    layer = Linear(1024, 4096, bias=False)
    layer.requires_grad_(False)
    pack_linears(layer)
    if layer.panels is None:
        pytest.skip("panel_linear is off on this machine: nothing is collapsed")
    x = torch.randn(3, 1024)
    before = layer(x)
    if collapse_panels(layer) == 0:
        pytest.skip("this kernel gives no huge pages here")
    assert _anon_huge_kb(layer.panels.data_ptr() + HUGE_PAGE) > 0
    assert torch.equal(layer(x), before)
