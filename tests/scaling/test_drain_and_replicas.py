"""2P2D on the shipped hybrid with two ingress replicas: a decode engine drained in the middle of
32 streams loses none of them (their outputs equal the undisturbed ones, the drained engine's
requests resumed token for token elsewhere), and an ingress replica killed mid-load costs only
the streams it was carrying, each ending in a clear error that a client retry recovers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
from ray import serve

from tests.scaling.conftest import (
    TIMEOUT_S,
    Outcome,
    body,
    config,
    controller,
    deployed,
    engine,
    start_streams,
    stream,
    wait_idle_everywhere,
)

pytestmark = pytest.mark.scaling

PROMPTS = [f"ab={i:03d};qe={(37 * i) % 1000:03d};zt={(91 * i) % 1000:03d};?qe=" for i in range(32)]
# How a stream whose replica died may end: the proxy's status, an error event, a cut connection
# or a stream closed without `[DONE]` (tests/scaling/conftest.py `stream`).
CLEAR_ENDS = ("HTTP 5", "error event", "RemoteProtocolError", "ReadError", "the stream ended without [DONE]")
MAX_TOKENS = 160  # 20 ms a step at least: a stream lasts seconds, so it is cut in the middle


@pytest.fixture(scope="module")
def server(ray_cluster):
    cfg = config(
        prefill=2,
        decode=2,
        api_replicas=2,
        router="least_loaded",  # the streams spread over both decode engines: the drained one has some
        drain_timeout_s=1,  # the drained engine's streams are still running: they move
        kv_lease_s=5,
        migration_timeout_s=60,
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def undisturbed(server) -> dict[str, str]:
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=body(p, MAX_TOKENS)) for p in PROMPTS))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return {p: r.json()["choices"][0]["text"] for p, r in zip(PROMPTS, rs, strict=True)}

    return asyncio.run(main())


async def _all_started(outcomes: list[Outcome], tasks: list[asyncio.Task]) -> None:
    while not all(o.events >= 2 for o in outcomes):
        assert not any(t.done() for t in tasks), "a stream ended before every stream had started"
        await asyncio.sleep(0.05)


def test_a_decode_engine_drained_mid_32_streams_loses_none(server, undisturbed):
    drained = "raypd-decode-1"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            outcomes, tasks = start_streams(client, [body(p, MAX_TOKENS) for p in PROMPTS])
            await _all_started(outcomes, tasks)
            held = (await engine(drained).stats.remote()).num_running
            await controller().drain.remote(drained)
            await asyncio.gather(*tasks)
            return outcomes, held

    outcomes, held = asyncio.run(main())
    assert held > 0  # the drained engine was serving streams when it was drained
    assert [o.error for o in outcomes] == [None] * len(PROMPTS)
    assert {p: o.text for p, o in zip(PROMPTS, outcomes, strict=True)} == undisturbed
    engines = ray.get(controller().engine_set.remote())
    assert drained not in engines.decode and list(engines.decode) == ["raypd-decode-0"]
    with pytest.raises(ValueError):
        engine(drained)  # stopped, its name free
    for name, stats in wait_idle_everywhere().items():
        assert stats.num_blocks_free == stats.num_blocks_total, name
    events = ray.get(controller().scale_events.remote())
    assert [(e.direction, e.name) for e in events] == [("down", drained)]
    ray.get(controller().add_engine.remote("decode"))  # 2P2D again for the next test


def _replicas() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::raypd#raypd-api")
    ]


def test_an_ingress_replica_killed_mid_load_costs_only_its_own_streams(server, undisturbed):
    replicas = _replicas()
    assert len(replicas) == 2, replicas

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            outcomes, tasks = start_streams(client, [body(p, MAX_TOKENS) for p in PROMPTS])
            await _all_started(outcomes, tasks)
            ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=False)
            await asyncio.gather(*tasks)
            # The client retries what failed; the other replica (and the one Serve starts in the
            # dead one's place, which takes the controller's engine set) serves it.
            retried = {}
            for p, o in zip(PROMPTS, outcomes, strict=True):
                if o.error is not None:
                    for _ in range(30):
                        again = await stream(client, body(p, MAX_TOKENS), Outcome())
                        if again.error is None:
                            break
                        await asyncio.sleep(1.0)
                    retried[p] = again
            return outcomes, retried

    outcomes, retried = asyncio.run(main())
    failed = [o.error for o in outcomes if o.error is not None]
    assert 0 < len(failed) < len(PROMPTS), failed  # one replica's streams, not both
    for error in failed:  # a clear end: a status, an error event, or no [DONE]
        assert error.startswith(CLEAR_ENDS), error
    for o in outcomes:
        if o.error is None:
            assert o.text == undisturbed[PROMPTS[outcomes.index(o)]]
    for p, again in retried.items():
        assert again.error is None and again.text == undisturbed[p]
    for _ in range(120):  # Serve brings the replica back, and the new one takes the same engine set
        deployment = serve.status().applications["raypd"].deployments["raypd-api"]
        if deployment.replica_states.get("RUNNING") == 2:
            break
        time.sleep(0.5)
    assert deployment.replica_states.get("RUNNING") == 2, deployment
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        for p in PROMPTS[:8]:  # over both replicas
            r = client.post("/v1/completions", json=body(p, MAX_TOKENS))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == undisturbed[p], r.text
    for name, stats in wait_idle_everywhere().items():
        assert stats.num_blocks_free == stats.num_blocks_total, name
