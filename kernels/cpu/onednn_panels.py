"""oneDNN's packed fp32 weight read in place as panels, for the few-row matmul kernel.

`Linear.pack` lays a weight out for oneDNN, which is the fast layout for a prefill's or a large
batch's rows. At a few rows (a decode step) oneDNN reads that layout at about half the speed a
core can stream it and pays ~15 us a call, so `cpu_kernels.panel_linear` reads the same buffer
instead (docs/design.md §13): no second copy of any weight. The layout is oneDNN's to
choose (it depends on the CPU); here, on AVX-512, it is blocks of 64 output columns stored
[k][column]. Which layout a buffer holds is not taken on trust: the panels are used only where
they read back the plain weight exactly, and otherwise every matmul stays with oneDNN.
"""

from __future__ import annotations

import ctypes

import torch

# The block widths the kernel reads: whole block rows of 16 to 64 columns.
_BLOCK_WIDTHS = (64, 48, 32, 16)
# Output columns compared at a time, so that checking a large weight copies only a slice of it.
_CHECK_COLUMNS = 1 << 14


def panels_of(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`packed`'s buffer as [blocks, kp, nb] where that reads back `weight` [out, in] (block b
    holds columns b*nb.. as [k][column], k padded to kp), else None. The result is a view of
    memory `packed` owns: it is valid only while `packed` is alive."""
    try:
        nbytes = torch.ops.mkldnn._nbytes(packed)
        address = torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):
        return None
    out_features, in_features = weight.shape
    floats = nbytes // 4
    if floats == 0 or out_features == 0:
        return None
    flat = torch.frombuffer((ctypes.c_float * floats).from_address(address), dtype=torch.float32)
    for nb in _BLOCK_WIDTHS:
        blocks = -(-out_features // nb)
        if floats % (blocks * nb) or floats // (blocks * nb) < in_features:
            continue
        panels = flat.view(blocks, floats // (blocks * nb), nb)
        if _reads_back(panels, weight):
            return panels
    return None


def _reads_back(panels: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether every element of `weight` sits where the panel layout says."""
    out_features, in_features = weight.shape
    nb = panels.shape[2]
    step = max(1, _CHECK_COLUMNS // nb)
    for first in range(0, panels.shape[0], step):
        lo, hi = first * nb, min(out_features, (first + step) * nb)
        part = panels[first : first + step, :in_features].permute(0, 2, 1).reshape(-1, in_features)
        if not torch.equal(part[: hi - lo], weight[lo:hi]):
            return False
    return True
