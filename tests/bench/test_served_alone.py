"""bench.peers drives one server at a time: an idle server's background processes slowed the
other's runs by a sixth when both were up. The servers here are context managers that record
what is up; the client is replaced by one that records which server each run reached."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import bench.peers
from bench.machine import Measured
from bench.peer_client import Sample
from bench.peers import served_alone


def test_each_server_is_up_alone_for_all_of_its_runs(monkeypatch: pytest.MonkeyPatch):
    up: set[str] = set()
    runs: list[tuple[str, int, int]] = []

    def server(name: str):
        @contextmanager
        def start() -> Iterator[str]:
            assert not up, f"{name} started while {up} was up"
            up.add(name)
            try:
                yield name
            finally:
                up.remove(name)

        return start

    async def drive(url: str, model: str, prompts: list[list[int]], streams: int, max_tokens: int):
        assert up == {url}
        runs.append((url, streams, len(prompts)))
        return [Sample(0.1, [0.01] * (max_tokens - 1), 0.2, max_tokens) for _ in prompts], 1.0

    monkeypatch.setattr(bench.peers, "drive", drive)
    monkeypatch.setattr(bench.peers, "settle", lambda: None)
    args = argparse.Namespace(streams=[1, 4], rounds=2, requests_per_stream=1, prompt_len=8, max_tokens=5)
    got = served_alone({"a": server("a"), "b": server("b")}, "m", args, min_requests=3)

    assert runs == [("a", 1, 3), ("a", 4, 4), ("b", 1, 3), ("b", 4, 4)] * 2
    # Two rounds of 3 requests of 5 tokens in 1 s each at 1 stream; of 4 requests at 4.
    assert got["a"][1]["output_tok_per_s"] == pytest.approx(15.0)
    assert got["b"][4]["output_tok_per_s"] == pytest.approx(20.0)
    assert not up


def test_the_probe_brackets_each_one_stream_run(monkeypatch: pytest.MonkeyPatch):
    """The machine is measured right before and right after every 1-stream run, and each
    server's 1-stream summary carries the mean of its own probes."""
    events: list[str] = []
    readings = iter([10e9, 30e9, 50e9, 70e9, 20e9, 40e9, 60e9, 80e9])

    @contextmanager
    def server(name: str) -> Iterator[str]:
        yield name

    def probe() -> Measured:
        events.append("probe")
        bandwidth = next(readings)
        return Measured(bandwidth, bandwidth * 10, 2, 1)

    async def drive(url: str, model: str, prompts: list[list[int]], streams: int, max_tokens: int):
        events.append(f"{url}{streams}")
        return [Sample(0.1, [0.01] * (max_tokens - 1), 0.2, max_tokens) for _ in prompts], 1.0

    monkeypatch.setattr(bench.peers, "drive", drive)
    monkeypatch.setattr(bench.peers, "settle", lambda: None)
    args = argparse.Namespace(streams=[1, 4], rounds=2, requests_per_stream=1, prompt_len=8, max_tokens=5)
    got = served_alone({"a": lambda: server("a"), "b": lambda: server("b")}, "m", args, probe=probe)

    assert events == ["probe", "a1", "probe", "a4", "probe", "b1", "probe", "b4"] * 2
    # a had the 1st, 2nd, 5th and 6th readings; b the others.
    assert got["a"][1]["bandwidth_gb_s"] == pytest.approx(25.0)
    assert got["b"][1]["bandwidth_gb_s"] == pytest.approx(65.0)
    assert got["a"][1]["matmul_peak_gflop_s"] == pytest.approx(250.0)
    assert "bandwidth_gb_s" not in got["a"][4]
