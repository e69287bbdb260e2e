"""Cross-memory attach: copy bytes out of another process with one `process_vm_readv` call.

UCX's `cma` transport moves a same-host NIXL READ this way, so it is the ceiling any
inter-process copy reaches on one machine without shared memory (the kernel pins and
copies page by page). Linux only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]  # noqa: RUF012 (ctypes reads it)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t
_LIBC.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def read_spans(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> None:
    """Fill the local (address, bytes) spans from the remote ones of process `pid`."""
    iov = _Iovec * len(local)
    mine = iov(*[_Iovec(addr, size) for addr, size in local])
    theirs = iov(*[_Iovec(addr, size) for addr, size in remote])
    want = sum(size for _, size in local)
    got = _LIBC.process_vm_readv(pid, mine, len(local), theirs, len(remote), 0)
    if got != want:
        raise OSError(ctypes.get_errno(), f"process_vm_readv moved {got} of {want} bytes from pid {pid}")
