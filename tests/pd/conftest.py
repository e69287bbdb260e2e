from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (4 logical CPUs: the actors take none)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
