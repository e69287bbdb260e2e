"""The shipped hybrid models' accuracy through the real deployments: colocated and PD equal
the in-process reference, and PD collapses only with the fix switched off. Each run is
`python -m bench.accuracy` with those flags, called in this process on the package's Ray
cluster: a process, or a cluster, of its own would only add its start to each of the runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.accuracy import evaluate, parse_args

COMMON = ["--limit", "40", "--worker-threads", "1"]
MODELS = Path(__file__).resolve().parents[2] / "models"


def accuracy(*flags: str) -> dict:
    return evaluate(parse_args(list(flags)))


@pytest.fixture(scope="module", params=["tiny-hybrid", "tiny-qwen35"])
def model(request) -> str:
    return str(MODELS / request.param)


@pytest.fixture(scope="module")
def local(model) -> dict:
    return accuracy("--mode", "local", "--model", model, "--limit", "40")


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_deployments_equal_local(ray_cluster, model, local, mode):
    got = accuracy("--mode", mode, "--model", model, *COMMON)
    assert (got["n"], got["correct"]) == (local["n"], local["correct"])
    assert local["accuracy"] >= 0.9


def test_pd_without_the_fix_collapses(ray_cluster, model):
    flags = ["--debug-zero-loaded-blocks", "--debug-stream-delay-ms", "20"]
    got = accuracy("--mode", "pd", "--model", model, *flags, *COMMON)
    assert got["accuracy"] < 0.2
