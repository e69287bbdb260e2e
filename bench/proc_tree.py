"""The processes below one, read from Linux `/proc`: a server started from a bench (or a test)
is everything below its process, Ray's workers included, which leave its process group; a
local cluster's raylet is a child of the driver and every worker a child of the raylet, so the
driver's descendants are exactly this deployment's, not those of other clusters on the machine.
"""

from __future__ import annotations

from pathlib import Path

_PROC = Path("/proc")


def _stat(pid: int) -> list[str] | None:
    """Fields 3 on of /proc/PID/stat (state, parent, ...); None once the process is gone."""
    try:
        # The name in parentheses before them may hold spaces.
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def title(pid: int) -> str:
    """The first word of the process's command line (a Ray actor's `ray::Class` title)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(root: int) -> list[int]:
    """The processes below `root`, children before their own children."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
