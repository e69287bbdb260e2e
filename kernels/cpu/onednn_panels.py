"""oneDNN's packed fp32 weight read in place as panels, for the few-row matmul kernel.

`Linear.pack` lays a weight out for oneDNN, which is the fast layout for a prefill's or a large
batch's rows. At a few rows (a decode step) oneDNN reads that layout at about half the speed a
core can stream it and pays ~15 us a call, so `cpu_kernels.panel_linear` reads the same buffer
instead (docs/design.md §13): no second copy of any weight. Which layout a buffer holds is not
taken on trust: the panels are used only where they read back the plain weight exactly, and
otherwise every matmul stays with oneDNN.

The layout is oneDNN's to choose, by the widest instruction set it may use. What it chooses
for torch's `_reorder_linear_weight` (torch 2.13, oneDNN 3.12; oneDNN's names, dim a the
output, b the input), read on an Intel Xeon with AVX-512 and AMX with oneDNN capped by
`ONEDNN_MAX_CPU_ISA` to each of SSE41, AVX, AVX2, AVX2_VNNI, AVX512_CORE(_VNNI, _BF16, _FP16)
and AVX512_CORE_AMX, and the 64-column blocks also on the AMD EPYC (AVX2) of §13's timings:

- AVX2 and wider (oneDNN's brgemm matmul): `AB16b64a`, blocks of 64 output columns stored
  [k][column], k padded to 16, the last block zero-padded; with AVX2 `AB16b16a`, blocks of 16,
  for some shapes (129 outputs). The kernel reads both: "panels".
- below AVX2 (SSE4.1 or AVX only, oneDNN's gemm): unblocked, "plain": `ba`, the weight
  transposed ([in][out]), for most shapes, and `ab`, the weight as it is ([out][in]), for some
  (3072 x 512). The kernel reads `ba` only where it is one block of 16-64 columns; any other
  such weight stays with oneDNN.
- one output column, on every CPU: the weight as it is (`ab`, also `ba`): "plain".

`documented_layout` says which of these this CPU should give a weight of several blocks, so a
test fails where oneDNN starts choosing something else (a torch upgrade would otherwise lose
the fast path in silence, every layer falling back to oneDNN).
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Literal

import torch

from kernels.cpu.ops import cpu_features

# The block widths the kernel reads: whole block rows of 16 to 64 columns.
_BLOCK_WIDTHS = (64, 48, 32, 16)
# Output columns compared at a time, so that checking a large weight copies only a slice of it.
_CHECK_COLUMNS = 1 << 14
# `ONEDNN_MAX_CPU_ISA` values that keep oneDNN below AVX2 (its gemm, and the plain layout).
_BELOW_AVX2 = ("SSE41", "AVX")

Layout = Literal["panels", "plain"]


def panels_of(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`packed`'s buffer as [blocks, kp, nb] where that reads back `weight` [out, in] (block b
    holds columns b*nb.. as [k][column], k padded to kp), else None. The result reads memory
    that `packed` owns, and it holds `packed` (through its storage, as does every view taken
    of it): the panels cannot outlive the buffer they read, whatever drops `packed`."""
    flat = _buffer(packed)
    out_features, in_features = weight.shape
    if flat is None or out_features == 0:
        return None
    floats = flat.numel()
    for nb in _BLOCK_WIDTHS:
        blocks = -(-out_features // nb)
        if floats % (blocks * nb) or floats // (blocks * nb) < in_features:
            continue
        panels = flat.view(blocks, floats // (blocks * nb), nb)
        if _reads_back(panels, weight):
            return panels
    return None


def layout_of(packed: torch.Tensor, weight: torch.Tensor) -> Layout | None:
    """Which documented layout `packed` holds `weight` [out, in] in: "panels" where the kernel
    reads it, "plain" where it is the weight unblocked ([out][in] or [in][out]), None for any
    other."""
    if panels_of(packed, weight) is not None:
        return "panels"
    flat = _buffer(packed)
    if flat is None or flat.numel() != weight.numel():
        return None
    if torch.equal(flat.view(weight.shape), weight) or torch.equal(flat.view(weight.T.shape), weight.T):
        return "plain"
    return None


def documented_layout() -> Layout | None:
    """The layout oneDNN documents (above) for a weight of several output blocks on this CPU:
    "panels" where it may use AVX2, "plain" on an x86-64 CPU without it (or with oneDNN capped
    below it), None on another architecture, whose layouts nobody has read yet."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return "panels" if "avx2" in cpu_features() and cap.upper() not in _BELOW_AVX2 else "plain"


def _buffer(packed: torch.Tensor) -> torch.Tensor | None:
    """`packed`'s bytes as one fp32 tensor, which keeps `packed` alive: torch reads oneDNN's
    buffer through a ctypes array at its address, which owns nothing, so the array holds
    `packed` and the tensor's storage holds the array."""
    try:
        nbytes = torch.ops.mkldnn._nbytes(packed)
        address = torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):
        return None
    floats = nbytes // 4
    if floats == 0:
        return None
    array = (ctypes.c_float * floats).from_address(address)
    array.owner = packed
    return torch.frombuffer(array, dtype=torch.float32)


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
