"""Collapsing a weight onto huge pages keeps its contents and its address, and the pages it
reports are huge in the process's own map; a weight smaller than a huge page is left alone.

The collapsing runs in a child process: memory it puts on huge pages goes back to the
allocator's heap when freed, and a later test's fresh tensor there would sit on them too
(tests/kv/nixl/test_host_pages.py checks that ordinary memory does not)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kernels.cpu.huge_pages import HUGE_PAGE

_REPO = Path(__file__).resolve().parents[3]

_CHILD = textwrap.dedent(
    """
    import json, os
    import torch
    from kernels.cpu.huge_pages import HUGE_PAGE, collapse
    from models.layers import Linear, collapse_panels, pack_linears
    from tests.huge_pages import huge_kib_at

    out = {}
    t = torch.arange(8 * HUGE_PAGE // 4, dtype=torch.float32)  # 16 MiB: at least 7 whole huge pages
    expected, address = t.clone(), t.data_ptr()
    out["moved"] = collapse(t)
    out["same"] = t.data_ptr() == address and torch.equal(t, expected)
    out["huge_kib"] = huge_kib_at(os.getpid(), address)
    out["small"] = collapse(torch.ones(1000))
    out["strided"] = collapse(torch.ones(HUGE_PAGE // 4, dtype=torch.float32)[::2])

    torch.manual_seed(0)
    layer = Linear(1024, 4096, bias=False)
    layer.requires_grad_(False)
    pack_linears(layer)
    out["panels"] = layer.panels is not None
    if out["panels"]:
        x = torch.randn(3, 1024)
        before = layer(x)
        out["panels_moved"] = collapse_panels(layer)
        out["panels_huge_kib"] = huge_kib_at(os.getpid(), layer.panels.data_ptr() + HUGE_PAGE)
        out["panels_same"] = torch.equal(layer(x), before)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_collapse_keeps_the_contents_on_huge_pages(child: dict[str, Any]):
    moved = child["moved"]
    if moved == 0:
        pytest.skip("this kernel gives no huge pages here (THP set to never, Linux before 6.1, or none free)")
    assert moved % HUGE_PAGE == 0 and moved >= 7 * HUGE_PAGE
    assert child["same"]
    assert child["huge_kib"] >= moved // 1024


def test_a_tensor_within_one_huge_page_is_left_alone(child: dict[str, Any]):
    assert child["small"] == 0
    assert child["strided"] == 0  # not contiguous


def test_collapsed_panels_compute_what_they_did(child: dict[str, Any]):
    if not child["panels"]:
        pytest.skip("panel_linear is off on this machine: nothing is collapsed")
    if child["panels_moved"] == 0:
        pytest.skip("this kernel gives no huge pages here")
    assert child["panels_huge_kib"] > 0
    assert child["panels_same"]
