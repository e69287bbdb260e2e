"""What a long-lived raypd process sets up once it has started: its CPUs and its garbage collector.

Binding the workers' compute threads to listed CPUs, and the service's processes to the rest:
on a machine with few cores the engine's, the API replica's and Serve's wake-ups (a few per
token) land on the core the forward runs on and stall it for a time slice. vLLM CPU binds its
compute threads (`VLLM_CPU_OMP_THREADS_BIND`); `--worker-cpus` does the same here, and the
engine and API processes keep off those CPUs.
"""

from __future__ import annotations

import gc
import os


def parse_cpus(text: str) -> tuple[int, ...]:
    """`"0-3,8"` -> (0, 1, 2, 3, 8); ValueError naming what is wrong."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())):
            raise ValueError(f"{part.strip()!r} is not a CPU number or range (a list looks like 0-3,8)")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"the range {part.strip()!r} runs backwards")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError("a CPU is listed twice")
    return tuple(cpus)


def rank_cpus(cpus: tuple[int, ...], rank: int, size: int) -> tuple[int, ...]:
    """Rank `rank` of a `size`-rank engine's equal share of `cpus` (the ranks compute at once)."""
    if len(cpus) < size:
        raise ValueError(f"{len(cpus)} CPUs cannot be shared out among {size} tensor-parallel ranks")
    per = len(cpus) // size
    return cpus[rank * per : (rank + 1) * per]


def check_cpus(cpus: tuple[int, ...]) -> None:
    """ValueError unless this process may run on every one of `cpus`."""
    available = os.sched_getaffinity(0)
    if not set(cpus) <= available:
        raise ValueError(f"worker_cpus {list(cpus)}: this node offers CPUs {sorted(available)} only")


def bind_thread(cpus: tuple[int, ...]) -> None:
    """Bind the calling thread, and the threads it starts later (torch's OpenMP pool), to `cpus`."""
    os.sched_setaffinity(0, cpus)


def keep_off(worker_cpus: tuple[int, ...]) -> None:
    """Bind every thread of this process to the CPUs the workers were not given, if any are left
    (with no workers' CPUs, or none other on the node, the process stays where it was)."""
    rest = os.sched_getaffinity(0) - set(worker_cpus)
    if not worker_cpus or not rest:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), rest)
        except ProcessLookupError:
            continue  # the thread ended meanwhile


def freeze_startup_objects() -> None:
    """Move what start-up made (Ray, torch, the model: ~200k objects in a worker) out of the
    collector's reach. Those objects live as long as the process, yet every full collection
    walked them: 108 ms each time in a worker, a stall inside a step; 0.0 ms once frozen."""
    gc.freeze()
