"""Bad days for the KV path, on real Ray actors moving real bytes over NIXL/UCX: a READ that
never completes, a decode side that never reads or dies, a decode queue longer than the
lease, peers of another cache layout, a restarted prefill engine. Each case states its
request count and outcome, and checks free == total on every engine after."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

from actors.client import ActorSlot, EngineCalls, EngineClient
from actors.engine_actor import RemoteEngine
from engine.config import Config
from engine.messages import SamplingParams
from kv.nixl.compat import KVCompatError
from serve.engines import EngineSupervisor, start_engines, stop_engines
from tests.engine.test_core import alone, workload
from tests.models.hf_fixtures import save_hf_model
from tests.pd.test_pd_engines import DEVICE, check_idle, run_pd, start_pd
from tests.ray_session import stop_actors

NUM_REQUESTS = 4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    save_hf_model("nemotron_h", path)
    return str(path)


@pytest.fixture(scope="module")
def reference(hybrid):
    reqs = workload(NUM_REQUESTS, seed=13)
    return reqs, alone(hybrid, reqs)


def base(path: str, **kw) -> Config:
    fields = {
        "model": path,
        "dtype": "float32",
        "device": DEVICE,
        "block_size": 4,
        "num_kv_blocks": 200,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "worker_threads": 1,
        "seed": 3,
    }
    return Config(**(fields | kw))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_read_that_never_completes_times_out_into_the_policy(ray_cluster, hybrid, reference, policy):
    """Every READ is held back a minute; the 1 s transfer timeout fails each load, and the
    policy recomputes (same greedy output) or fails the request with the reason. `run_pd`
    checks free == total on both engines once idle."""
    reqs, want = reference
    cfg = base(hybrid, kv_transfer_timeout_s=1, debug_kv_delay_ms=60_000, kv_load_failure_policy=policy)
    got, stats = run_pd(cfg, reqs)
    assert stats.extra["failed_loads"] == NUM_REQUESTS
    assert sum(t.failed for t in stats.extra["kv_transfer"]) == NUM_REQUESTS
    if policy == "recompute":
        assert [t for t, _, _ in got] == want
        assert all(r == "length" for _, r, _ in got)
    else:
        assert all(r == "error" and "KV transfer" in (e or "") for _, r, e in got)


def test_a_short_delay_within_the_timeout_still_loads(ray_cluster, hybrid, reference):
    """The fault alone is no failure: READs held back 300 ms land within the timeout."""
    reqs, want = reference
    got, stats = run_pd(base(hybrid, kv_transfer_timeout_s=5, debug_kv_delay_ms=300), reqs)
    assert [t for t, _, _ in got] == want
    assert stats.extra["failed_loads"] == 0


def test_a_decode_queue_longer_than_the_lease_keeps_its_kv(ray_cluster, hybrid, reference):
    """One request decodes at a time, slowly (48 steps of at least 40 ms each), so the last
    waits several 2 s leases: the decode side's heartbeats renew them, and no load expires
    or fails (before heartbeats, 1 s leases and 24 tokens expired 3 of the 4)."""
    reqs, _ = reference
    cfg = base(hybrid, kv_lease_s=2, max_num_seqs=1, debug_stream_delay_ms=40)
    slow = [(p, 48) for p, _ in reqs]
    got, stats = run_pd(cfg, slow)
    assert [t for t, _, _ in got] == alone(hybrid, slow)
    assert stats.extra["expired_leases"] == 0 and stats.extra["failed_loads"] == 0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def client(engine) -> EngineClient:
    """One client per engine per test: an engine's outputs go to one consumer, so a second
    client's poller would take the first one's outputs."""
    return EngineClient(EngineCalls.remote(ActorSlot(engine)))


async def prefill_only(pre: EngineClient, reqs, tag: str) -> list[dict]:
    """Hand each prompt over and keep the transfer parameters: no decode side reads them."""

    async def one(i: int, prompt: list[int]) -> dict:
        params = None
        async for out in pre.generate(prompt, greedy(1), f"{tag}-{i}", do_remote_decode=True):
            params = out.kv_transfer_params
        assert params is not None
        return params

    return list(await asyncio.gather(*(one(i, p) for i, (p, _) in enumerate(reqs))))


async def decode_with(dec: EngineClient, reqs, params: list[dict], tag: str) -> list[tuple[list[int], str | None]]:
    async def one(i: int, prompt: list[int], n: int) -> tuple[list[int], str | None]:
        toks, reason = [], None
        async for out in dec.generate(prompt, greedy(n), f"{tag}-{i}", kv_transfer_params=params[i]):
            toks.extend(out.new_token_ids)
            reason = out.finish_reason
        return toks, reason

    return list(await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs))))


def test_a_decode_side_that_never_reads_frees_at_lease_end_and_a_late_reader_recomputes(ray_cluster, hybrid, reference):
    """4 requests are handed over and never read: the prefill engine frees all their blocks
    when the 1 s leases end. Read afterwards, each load is refused before its READ (the lease
    is gone) and recomputed: the output is right, never built from reused pages."""
    reqs, want = reference
    prefill, decode = start_pd(base(hybrid, kv_lease_s=1))

    async def main() -> list[tuple[list[int], str | None]]:
        pre, dec = client(prefill), client(decode)
        try:
            params = await prefill_only(pre, reqs, "held")
            assert ray.get(prefill.stats.remote()).extra["held_for_decode"] == NUM_REQUESTS
            check_idle(prefill)  # returns once the leases have ended
            assert ray.get(prefill.stats.remote()).extra["held_for_decode"] == 0
            return await decode_with(dec, reqs, params, "late")
        finally:
            await pre.close()
            await dec.close()

    try:
        got = asyncio.run(main())
        assert [t for t, _ in got] == want and all(r == "length" for _, r in got)
        stats = ray.get(decode.stats.remote())
        assert stats.extra["expired_leases"] == NUM_REQUESTS and stats.extra["failed_loads"] == NUM_REQUESTS
        check_idle(prefill, decode)
    finally:
        stop_actors(prefill, decode)


def test_a_killed_decode_side_stops_renewing_and_the_prefill_side_frees(ray_cluster, hybrid, reference):
    """4 requests queue at a slow decode engine that decodes one at a time: its heartbeats keep
    their 2 s leases past the first lease. Killed, it renews no more, and the prefill engine
    frees every block within a lease."""
    reqs, _ = reference
    cfg = base(hybrid, kv_lease_s=2, max_num_seqs=1, debug_stream_delay_ms=40)
    prefill, decode = start_pd(cfg)
    try:
        params = asyncio.run(prefill_then_close(prefill, reqs))
        ray.get([decode.add_request.remote(f"q-{i}", p, greedy(48), params[i]) for i, (p, _) in enumerate(reqs)])
        time.sleep(3.0)
        assert ray.get(prefill.stats.remote()).extra["held_for_decode"] > 0
        ray.kill(decode)
        check_idle(prefill)
    finally:
        stop_actors(prefill)


def test_engines_of_different_block_sizes_are_refused_before_any_request(ray_cluster, hybrid):
    prefill = RemoteEngine.remote(base(hybrid).to_dict(), "prefill", "prefill-bs4")
    decode = RemoteEngine.remote(base(hybrid, block_size=8).to_dict(), "decode", "decode-bs8")
    try:
        peers = ray.get(prefill.nixl_peers.remote())
        with pytest.raises(KVCompatError, match=r"block_size 4 \(peer\) vs 8 \(here\)"):
            ray.get(decode.add_nixl_peers.remote(peers))
        assert ray.get(decode.nixl_peer_names.remote()) == []
    finally:
        stop_actors(prefill, decode)


async def prefill_then_close(engine, reqs) -> list[dict]:
    pre = client(engine)
    try:
        return await prefill_only(pre, reqs, "held")
    finally:
        await pre.close()


def test_a_restarted_prefill_engine_is_read_through_its_new_agent_only(ray_cluster, hybrid, reference):
    """The deployment's own wiring (start_engines, EngineSupervisor.replace): after the prefill
    engine is killed and replaced, the decode engine knows only the new agent. 4 requests whose
    KV the dead engine handed over fail their loads cleanly and recompute; 4 new ones load
    from the new engine; outputs equal the reference, free == total on both."""
    reqs, want = reference
    restart_prefill_and_read(dataclasses.replace(base(hybrid), prefill=1, decode=1), reqs, want)


def restart_prefill_and_read(cfg: Config, reqs, want: list[list[int]]) -> None:
    """Kill and replace the prefill engine of a 1P1D deployment between two rounds of `reqs`:
    the stale round's loads fail and recompute, the fresh round loads, both give `want`."""
    engines: dict = {}
    names = start_engines(cfg, engines)
    pre_name, dec_name = names["prefill"][0], names["decode"][0]

    def failed_loads() -> int:
        return ray.get(engines[dec_name].stats.remote()).extra["failed_loads"]

    async def main() -> None:
        old_agents = ray.get(engines[dec_name].nixl_peer_names.remote())
        stale = await prefill_then_close(engines[pre_name], reqs)
        ray.kill(engines[pre_name], no_restart=True)
        sup = EngineSupervisor(cfg, engines, lambda name, handle: engines.__setitem__(name, handle))
        await sup.replace(pre_name)
        new_agents = ray.get(engines[dec_name].nixl_peer_names.remote())
        assert len(new_agents) == len(old_agents) == cfg.tp_size("prefill")
        assert not set(new_agents) & set(old_agents)
        dec = client(engines[dec_name])
        try:
            got = await decode_with(dec, reqs, stale, "stale")
            assert [t for t, _ in got] == want and failed_loads() == len(reqs)
            pre = client(engines[pre_name])
            fresh = await decode_with(dec, reqs, await prefill_only(pre, reqs, "fresh"), "fresh")
            await pre.close()
            assert [t for t, _ in fresh] == want and failed_loads() == len(reqs)
        finally:
            await dec.close()

    try:
        asyncio.run(main())
        check_idle(engines[pre_name], engines[dec_name])
    finally:
        stop_engines(list(engines), timeout_s=10)


@pytest.mark.parametrize("verify", [True, False])
def test_a_corrupted_page_is_caught_by_kv_verify_and_recomputed(ray_cluster, hybrid, reference, verify):
    """Every landed load has its first block's pages corrupted on the decode side. With
    --kv-verify all 4 loads fail their checksums and recompute to the right output; without
    it the corruption goes unnoticed and outputs go wrong (the fault is real)."""
    reqs, want = reference
    got, stats = run_pd(base(hybrid, kv_verify=verify, debug_kv_corrupt_percent=100), reqs)
    toks = [t for t, _, _ in got]
    if verify:
        assert toks == want
        assert stats.extra["failed_loads"] == NUM_REQUESTS
        assert sum(t.corrupt for t in stats.extra["kv_transfer"]) == NUM_REQUESTS
    else:
        assert toks != want and stats.extra["failed_loads"] == 0
