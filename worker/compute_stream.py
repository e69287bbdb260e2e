"""The one ordered queue a worker's device work runs on.

A worker zeroes new attention pages and runs its forward on a single stream, so step N+1's
zeroing is queued behind step N's forward (docs/design.md §1). NIXL transfers do not go through
this queue: they land whenever UCX completes them, which is exactly the window in which a
late zeroing can wipe loaded KV. On CUDA the queue is a `torch.cuda.Stream`; on CPU a single
FIFO thread plays that role, so the same race exists in CPU tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from actors.process import bind_thread, check_cpus
from kernels.cpu.ops import pin_team

T = TypeVar("T")


class ComputeStream:
    """Runs submitted jobs one at a time, in submission order.

    Jobs are launched from one executor thread; on CUDA each job's kernels go to the
    worker's own stream and its future resolves only after they have completed, so a
    resolved future means the device memory it touched is final.

    `delay_s` is for tests only: it sleeps before every job so the stream lags behind its
    submitter, which widens race windows (e.g. a transfer landing before a queued zeroing).
    """

    def __init__(self, device: torch.device | str = "cpu", delay_s: float = 0.0, cpus: tuple[int, ...] = ()) -> None:
        """`cpus`: bind the stream's thread, and torch's threads it starts, to these CPUs; on a
        CPU device with one thread a CPU, each thread to its own (`kernels.cpu.ops.pin_team`)."""
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.device = torch.device(device)
        self.delay_s = delay_s
        check_cpus(cpus)
        self._cuda: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            # Weights and caches were written on the default stream before this one existed;
            # let that finish so the first job never reads half-copied memory.
            torch.cuda.synchronize(self.device)
            self._cuda = torch.cuda.Stream(self.device)
        # OpenMP's thread count is per thread: the stream's thread would otherwise run every
        # matmul with the machine's default (all cores), whatever torch.set_num_threads the
        # creator asked for, and oversubscribed cores ran a decode step several times slower.
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="compute-stream",
            initializer=_start_thread,
            initargs=(torch.get_num_threads(), cpus, self.device.type == "cpu"),
        )

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._executor.submit(self._run, fn, args)

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._executor.shutdown(wait=True)

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._cuda is None:
            return fn(*args)
        with torch.cuda.stream(self._cuda):
            result = fn(*args)
            done = torch.cuda.Event()
            done.record(self._cuda)
        done.synchronize()
        return result


def _start_thread(num_threads: int, cpus: tuple[int, ...], pin: bool) -> None:
    if cpus:
        bind_thread(cpus)  # before torch starts its OpenMP threads, which inherit the binding
    torch.set_num_threads(num_threads)
    if cpus and pin:
        pin_team(cpus)
