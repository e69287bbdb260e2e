"""Weights moved onto 2 MiB pages in place (Linux `madvise(MADV_COLLAPSE)`, 6.1 and later).

A decode step streams every weight once, and on 4 KiB pages the stream crosses a page, and
may miss the TLB, every 4 KiB. With the machine's THP setting at `madvise` (the default of many
distributions) nothing in torch's weights is on huge pages. Over Qwen3-0.6B's 2.38 GB of panels
on an AMD EPYC (Zen 4) guest, alternating in one process, `panel_linear` read 1-9% faster at one
row and 5-16% at four once they were collapsed, where memory was fast (~45 GB/s), and 1-4% where
it was slow (~30 GB/s) (docs/design.md §13). The collapse copies each 2 MiB into a huge page
and keeps the contents and the addresses, so nothing that holds the buffer changes.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from functools import cache

import torch

HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # include/uapi/asm-generic/mman-common.h


@cache
def _madvise() -> Callable[[int, int, int], int]:
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def collapse(t: torch.Tensor) -> int:
    """Back the whole 2 MiB pages inside `t`'s memory with huge pages, in place; the bytes
    moved. 0 where the kernel cannot (not Linux, older than 6.1, THP off, no free huge page) or
    `t` spans no whole huge page: the weights then stay where they are, as they were."""
    if sys.platform != "linux" or t.device.type != "cpu" or not t.is_contiguous():
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    return hi - lo if _madvise()(lo, hi - lo, _MADV_COLLAPSE) == 0 else 0
