"""One local Ray cluster per test package that needs one: starting and stopping a cluster costs
~5.6 s, and the packages' modules each used to pay it. Each test leaves the cluster as it found
it (its actors shut down, its Serve app deleted) for the next."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from serve.engines import NAMESPACE
from serve.launch import quiet_local_cluster

SHUTDOWN_TIMEOUT_S = 30.0


@contextmanager
def ray_session() -> Iterator[None]:
    """A fresh local cluster (8 logical CPUs: the actors take none); refuses to start over a
    session that an earlier test left running, whose actors would be mistaken for this one's.
    Serve runs in it as in a cluster `python -m serve` starts (`QUIET_LOCAL_CLUSTER`)."""
    if ray.is_initialized():
        raise RuntimeError("a Ray session is already up: an earlier test left it running")
    quiet_local_cluster()
    ray.init(address="local", namespace=NAMESPACE, num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def stop_actors(*handles: Any) -> None:
    """Shut the engines or workers down and kill them. Dropping the last handle would free an
    actor only once the driver's garbage collector gets to it, and on a cluster shared by a
    whole package the idle ones pile up (dozens of processes, each waking every few seconds)."""
    try:
        ray.get([h.shutdown.remote() for h in handles], timeout=SHUTDOWN_TIMEOUT_S)
    finally:
        for h in handles:
            ray.kill(h)
