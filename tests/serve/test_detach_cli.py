"""`--detach` and `--stop` need a cluster to act on; without one they say so and start nothing."""

from __future__ import annotations

import pytest
import ray

from serve.__main__ import main


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for var in ("RAYPD_ADDRESS", "RAYPD_DETACH", "RAYPD_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def test_stop_without_a_cluster_names_what_is_missing(capsys):
    assert main(["--stop"]) == 2
    assert "--stop needs the cluster: give --address" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_detach_without_a_cluster_refuses_before_starting_one(capsys):
    assert main(["--detach"]) == 1
    assert "--detach needs a running cluster" in capsys.readouterr().err
    assert not ray.is_initialized()
