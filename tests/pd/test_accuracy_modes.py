"""The shipped hybrid model's accuracy through the real deployments: colocated and PD equal
the in-process reference, and PD collapses only with the fix switched off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COMMON = ["--limit", "40", "--worker-threads", "1"]


def accuracy(*flags: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.accuracy", *flags], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def local() -> dict:
    return accuracy("--mode", "local", "--limit", "40")


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_deployments_equal_local(local, mode):
    got = accuracy("--mode", mode, *COMMON)
    assert (got["n"], got["correct"]) == (local["n"], local["correct"])
    assert local["accuracy"] >= 0.9


def test_pd_without_the_fix_collapses():
    got = accuracy("--mode", "pd", "--debug-zero-loaded-blocks", "--debug-stream-delay-ms", "20", *COMMON)
    assert got["accuracy"] < 0.2
