"""KV-transfer counters: the histogram's buckets, and a real connector pair (two NIXL agents in
this process, UCX on loopback) counting loads, pages, bytes and failures."""

from __future__ import annotations

import time

import pytest
import torch

from kv.nixl.transfer_params import KVTransferParams
from kv.nixl.transfer_stats import Histogram
from kv.nixl.worker import NixlWorkerConnector

PAGE, BLOCKS, BUFFERS = 64, 8, 2


def test_histogram_buckets_are_upper_inclusive_and_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.count == 5
    assert h.total == pytest.approx(4.65)
    assert h.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    c = h.copy()
    c.observe(0.0)
    assert h.count == 5 and c.count == 6


@pytest.mark.parametrize("bounds", [(1.0, 0.5), (0.5, 0.5)])
def test_histogram_rejects_unsorted_bounds(bounds):
    with pytest.raises(ValueError, match="increase strictly"):
        Histogram(bounds)


def wait_ended(conn: NixlWorkerConnector, req_id: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        got = conn.get_finished()
        if req_id in got.done_recving or req_id in got.failed:
            return
        assert time.monotonic() < deadline, f"load {req_id} did not end"
        time.sleep(0.001)


def make(name: str, fail_fraction: float = 0.0) -> NixlWorkerConnector:
    bufs = [torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for _ in range(BUFFERS)]
    return NixlWorkerConnector(name, bufs, PAGE, BLOCKS, fail_fraction=fail_fraction)


def test_connector_counts_completed_and_failed_loads():
    src, dst, faulty = make("src"), make("dst"), make("faulty", fail_fraction=1.0)
    try:
        for conn in (dst, faulty):
            conn.add_peer(src.metadata())
        assert dst.transfer_stats().seconds.count == 0
        dst.start_load("r1", KVTransferParams("src", src.agent_name, ((0, 1, 2),), 12, "p1"), [[3, 4, 5]])
        wait_ended(dst, "r1")
        dst.start_load("r2", KVTransferParams("src", src.agent_name, ((6,),), 4, "p2"), [[7]])
        wait_ended(dst, "r2")
        stats = dst.transfer_stats()
        assert stats.seconds.count == 2 and stats.seconds.total > 0
        assert stats.descriptors == (3 + 1) * BUFFERS
        assert stats.bytes == (3 + 1) * BUFFERS * PAGE
        assert stats.failed == 0

        faulty.start_load("r3", KVTransferParams("src", src.agent_name, ((0, 1),), 8, "p3"), [[2, 3]])
        wait_ended(faulty, "r3")
        stats = faulty.transfer_stats()
        assert stats.failed == 1 and stats.seconds.count == 0 and stats.bytes == 0
        assert src.transfer_stats().seconds.count == 0  # the side read from moves nothing itself
    finally:
        for conn in (src, dst, faulty):
            conn.close()
