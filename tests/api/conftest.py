from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from ray import serve

from engine.config import Config
from serve import launch
from tests.models.hf_fixtures import save_hf_model
from tests.ray_session import ray_session


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random NemotronH with a word-level tokenizer over "t0".."t95" (EOS "t95")."""
    path = tmp_path_factory.mktemp("nemotron_h")
    save_hf_model("nemotron_h", path)
    return str(path)


@pytest.fixture(scope="package")
def ray_cluster():
    with ray_session():
        yield


@contextmanager
def deployed(cfg: Config) -> Iterator[launch.Deployment]:
    """The service on the package's cluster (`ray_cluster`). Serve goes with it: the next
    deployment's proxy listens on another port, and Serve keeps the first one it was given."""
    try:
        dep = launch.start(cfg)
        try:
            yield dep
        finally:
            launch.stop(dep)
    finally:
        serve.shutdown()  # also after a start that failed with Serve up
