"""What the kernel says about transparent huge pages, for tests that check the KV cache sits
on them (kv/nixl/host_pages.py)."""

from __future__ import annotations

from pathlib import Path


def thp_mode() -> str:
    """The kernel's THP mode ('always', 'madvise', 'never'), or 'absent'."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def huge_kib_at(pid: int, addr: int) -> int:
    """AnonHugePages of the mapping of process `pid` that holds `addr`."""
    return smaps_kib_at(pid, addr, "AnonHugePages")


def smaps_kib_at(pid: int, addr: int, field: str) -> int:
    """Field `field` (Rss, AnonHugePages, ...) of the mapping of process `pid` that holds `addr`, in KiB."""
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping of pid {pid} holds {addr:#x}")
