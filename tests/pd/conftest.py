from __future__ import annotations

import pytest

from tests.ray_session import ray_session


@pytest.fixture(scope="package")
def ray_cluster():
    with ray_session():
        yield
