"""One local Ray cluster per test package that needs one: starting and stopping a cluster costs
~5.6 s, and the packages' modules each used to pay it. Each test leaves the cluster as it found
it (its actors shut down, its Serve app deleted) for the next."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray

from serve.engines import NAMESPACE


@contextmanager
def ray_session() -> Iterator[None]:
    """A fresh local cluster (8 logical CPUs: the actors take none); refuses to start over a
    session that an earlier test left running, whose actors would be mistaken for this one's."""
    if ray.is_initialized():
        raise RuntimeError("a Ray session is already up: an earlier test left it running")
    ray.init(address="local", namespace=NAMESPACE, num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
