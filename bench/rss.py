"""Resident memory of the Ray worker processes this process started (Linux `/proc`): the
driver's descendants titled `ray::...` are exactly this deployment's actors (bench/proc_tree.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.proc_tree import descendants, title

_PROC = Path("/proc")


def _rss_bytes(pid: int) -> int:
    try:
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def ray_worker_rss(root: int | None = None) -> dict[str, int]:
    """Resident bytes of each `ray::` process descending from `root` (default: this process),
    keyed by `title (pid)`."""
    root = os.getpid() if root is None else root
    titles = {pid: title(pid) for pid in descendants(root)}
    return {f"{t} ({pid})": _rss_bytes(pid) for pid, t in titles.items() if t.startswith("ray::")}
