"""Host buffers on transparent huge pages, for the memory another process reads.

A same-host NIXL READ is UCX's `cma` transport, i.e. the kernel's `process_vm_readv`, which pins
and copies the source page by page: on 2 MiB pages it walks 512x fewer (64 MiB between two
processes here: 7.3 -> 11.9 GB/s, BENCHMARKS.md). A kernel whose THP mode is `madvise` gives huge
pages only to memory that asks before its first touch, so the buffer is a fresh anonymous mapping
that asks at once: the kernel hands it out zeroed, page by page on first touch, so there is no
zeroing pass at start-up (filling 1 GiB of huge pages took 2 s here, faulting it in 0.6 s). Where
the kernel cannot (THP off, not Linux) the request is ignored and the memory is ordinary.

Only the buffers ask, not the process (torch's `THP_MEM_ALLOC_ENABLE` would, but it is read once
per process, so it would have to reach every worker through its Ray runtime env, which made each
worker actor start about 0.5 s slower).
"""

from __future__ import annotations

import contextlib
import mmap

import torch

from kernels.cpu.huge_pages import HUGE_PAGE

# Linux only; elsewhere the memory stays ordinary.
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def huge_page_zeros(rows: int, cols: int) -> torch.Tensor:
    """A zeroed [rows, cols] uint8 host tensor starting on a huge-page boundary; the mapping
    lives as long as the tensor does."""
    nbytes = rows * cols
    # Private: a shared anonymous mapping is shmem, whose huge pages a separate knob governs.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE  # a multiple of the base page: the mapping starts on one
    if _MADV_HUGEPAGE is not None and nbytes:
        with contextlib.suppress(OSError):  # a kernel without THP refuses: ordinary pages then
            region.madvise(_MADV_HUGEPAGE, start, nbytes)
    buf = raw[start : start + nbytes]
    buf[:: mmap.PAGESIZE].zero_()  # fault every page in now (they read zero already)
    return buf.view(rows, cols)
