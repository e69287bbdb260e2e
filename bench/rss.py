"""Resident memory of the Ray worker processes this process started (Linux `/proc`).

A local cluster's raylet is a child of the driver and every worker process (engine, worker and
Serve actors) a child of the raylet, so the driver's descendants titled `ray::...` are exactly
this deployment's actors, not those of other clusters on the same machine.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def _parent(pid: int) -> int | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:  # gone meanwhile
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces


def _title(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


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
    parents = {int(p.name): _parent(int(p.name)) for p in _PROC.iterdir() if p.name.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found: dict[str, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        title = _title(pid)
        if title.startswith("ray::"):
            found[f"{title} ({pid})"] = _rss_bytes(pid)
    return found
