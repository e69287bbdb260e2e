from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="package")
def ray_cluster():
    """One local Ray cluster for the PD modules (4 logical CPUs: the actors take none): each
    test leaves it as it found it for the next, and a cluster per module, or per accuracy
    run, cost ~5.6 s of start and stop each time."""
    if ray.is_initialized():
        raise RuntimeError("a Ray session is already up: a test before the PD modules left it running")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
