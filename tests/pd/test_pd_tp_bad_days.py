"""Bad days under tensor parallelism (docs/design.md §12, per rank), on real Ray actors with
gloo TP groups moving real bytes over NIXL/UCX: a READ from two prefill ranks that never
completes, corrupted pages under --kv-verify when decode ranks read whole pages or head
slices, and peers whose caches differ refused on every rank. Each case states its request
count and outcome; `run_pd` checks free == total on both engines once idle."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch

from actors.engine_actor import RemoteEngine
from engine.config import DEFAULT_MODEL
from kv.nixl.compat import KVCompatError
from tests.engine.test_core import alone, workload
from tests.pd.test_pd_bad_days import restart_prefill_and_read
from tests.pd.test_pd_engines import DEVICE, run_pd
from tests.pd.test_pd_tp import config
from tests.ray_session import stop_actors

NUM_REQUESTS = 4

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="TP=2 on CUDA needs two GPUs"
)


@pytest.fixture(scope="module")
def reference():
    reqs = workload(NUM_REQUESTS, seed=13)
    return reqs, alone(DEFAULT_MODEL, reqs)


def test_a_hung_read_from_two_prefill_ranks_times_out(ray_cluster, reference):
    """Prefill TP 2, decode TP 1: the decode rank's READs from both prefill ranks are held
    back a minute; the 1 s timeout fails each of the 4 loads as a whole, and they recompute
    to the colocated output."""
    reqs, want = reference
    cfg = config(DEFAULT_MODEL, 2, 1, kv_transfer_timeout_s=1, debug_kv_delay_ms=60_000)
    got, stats = run_pd(cfg, reqs)
    assert [t for t, _, _ in got] == want
    assert stats.extra["failed_loads"] == NUM_REQUESTS


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 2)])
def test_kv_verify_catches_corruption_per_rank(ray_cluster, reference, prefill_tp, decode_tp):
    """Every decode rank corrupts the first block of each landed load: each rank's check
    fails (4 loads x decode TP), the engine fails each load once, and they recompute to the
    colocated output."""
    reqs, want = reference
    cfg = config(DEFAULT_MODEL, prefill_tp, decode_tp, kv_verify=True, debug_kv_corrupt_percent=100)
    got, stats = run_pd(cfg, reqs)
    assert [t for t, _, _ in got] == want
    assert stats.extra["failed_loads"] == NUM_REQUESTS
    assert sum(t.corrupt for t in stats.extra["kv_transfer"]) == NUM_REQUESTS * decode_tp


def test_a_compat_mismatch_is_refused_on_every_rank(ray_cluster):
    """Block sizes 4 and 8 at prefill TP 2, decode TP 2: every decode rank refuses every
    prefill rank's agent. Unequal TP sizes with the same cache are accepted."""
    prefill = RemoteEngine.remote(config(DEFAULT_MODEL, 2, 2).to_dict(), "prefill", "prefill-tp-bs4")
    decode = RemoteEngine.remote(
        dataclasses.replace(config(DEFAULT_MODEL, 2, 2), block_size=8).to_dict(), "decode", "decode-tp-bs8"
    )
    unequal = RemoteEngine.remote(config(DEFAULT_MODEL, 2, 1).to_dict(), "decode", "decode-tp1-bs4")
    try:
        peers = ray.get(prefill.nixl_peers.remote())
        assert len(peers) == 2
        with pytest.raises(KVCompatError, match=r"block_size 4 \(peer\) vs 8 \(here\)"):
            ray.get(decode.add_nixl_peers.remote(peers))
        assert ray.get(decode.nixl_peer_names.remote()) == []
        ray.get(unequal.add_nixl_peers.remote(peers))
        assert ray.get(unequal.nixl_peer_names.remote()) == sorted(p.agent_name for p in peers)
    finally:
        stop_actors(prefill, decode, unequal)


def test_a_restarted_prefill_engine_is_read_through_its_new_ranks_only(ray_cluster, reference):
    """Prefill TP 2, decode TP 2: after the prefill engine is replaced, every decode rank knows
    only the new engine's 2 rank agents; the 4 stale loads fail and recompute, 4 fresh ones
    load; outputs equal colocated, free == total on both."""
    reqs, want = reference
    restart_prefill_and_read(dataclasses.replace(config(DEFAULT_MODEL, 2, 2), decode=1), reqs, want)
