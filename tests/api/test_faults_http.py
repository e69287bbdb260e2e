"""The fault suite over real HTTP (1 prefill + 2 decode engines on Ray Serve, the shipped model).

Each case states its request count and outcome (`report`), and ends with every engine idle,
`free == total` on each and `/health` answering 200:
- a decode engine killed (`ray.kill`) mid-stream: the request goes on on the other decode
  engine (or the replacement) and its output (greedy, or seeded sampling) equals an undisturbed
  run, token for token, streamed and not;
- the prefill engine killed while requests are in flight: each is retried on its replacement
  and answers as undisturbed;
- 100 clients that drop their streams mid-way;
- overload at 3x the ingress capacity: every request is 200 or 503 with Retry-After, none lost
  or hung.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from actors.ports import free_port
from engine.config import Config
from serve.engines import NAMESPACE
from tests.api.conftest import deployed

pytestmark = pytest.mark.faults

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
PROMPTS = ["ab=381;qe=027;zt=950;?qe=", "mk=112;ow=903;?mk=", "ab=381;qe=027;zt=950;xx=555;yy=777;?yy="]
LONG_TOKENS = 240  # a stream long enough to be cut in the middle
CAPACITY = 100  # engine requests the ingress admits at once (max_inflight): all 100 dropping clients
TIMEOUT_S = 60.0  # per request: a hang fails the case instead of stalling it
DECODE = ("raypd-decode-0", "raypd-decode-1")
ENGINES = ("raypd-prefill-0", *DECODE)


def body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def report(case: str, **outcome: Any) -> None:
    """One JSON line per case, into the file RAYPD_FAULT_REPORT names (if any)."""
    path = os.environ.get("RAYPD_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, **outcome}) + "\n")


def engine(name: str) -> Any:
    return ray.get_actor(name, namespace=NAMESPACE)


def wait_healthy(client: httpx.Client, within_s: float = 60.0) -> None:
    """Until /health is 200 (the supervisor has replaced what was killed), then until every
    engine is idle with all its blocks back."""
    deadline = time.monotonic() + within_s
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the deployment did not become healthy again"
        time.sleep(0.25)
    for name in ENGINES:
        stats = ray.get(engine(name).wait_idle.remote(), timeout=within_s)
        assert stats.num_blocks_free == stats.num_blocks_total, (name, stats)


def kill_when_busy(names: tuple[str, ...], within_s: float = 20.0) -> str:
    """Kill the first of `names` that is running or holding a request; return its name."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for name in names:
            s = ray.get(engine(name).stats.remote())
            if s.num_running or s.num_waiting or s.extra.get("loading"):
                ray.kill(engine(name))
                return name
        time.sleep(0.01)
    raise AssertionError(f"none of {names} got busy")


def resumed(client: httpx.Client) -> float:
    """Engine requests resumed after their engine was lost, so far (the ingress's counter)."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == "raypd_requests_resumed_total")


def incarnations() -> dict[str, str]:
    """Each engine's current actor: a replaced engine is a new actor under the same name."""
    return {name: engine(name)._actor_id.hex() for name in ENGINES}


def stream_text(client: httpx.Client, req: dict[str, Any], on_event: Any = None) -> tuple[str, dict[str, Any]]:
    """The streamed text and usage of a completion; `on_event(i)` runs after the i-th chunk."""
    texts, usage, n = [], {}, 0
    with client.stream(
        "POST", "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                texts.append(event["choices"][0]["text"])
            if event.get("usage"):
                usage = event["usage"]
            n += 1
            if on_event is not None:
                on_event(n)
    return "".join(texts), usage


@pytest.fixture(scope="module")
def server(ray_cluster):
    cfg = Config(
        model=str(MODEL_DIR),
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        max_model_len=512,
        max_num_seqs=16,
        max_inflight=CAPACITY,
        worker_threads=1,
        port=free_port(),
        prefill=1,
        decode=2,
        kv_lease_s=5,
        debug_stream_delay_ms=5,  # a step takes at least 5 ms, so a stream can be cut mid-way
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def undisturbed(http) -> dict[str, str]:
    """Each prompt's greedy output with nothing killed."""
    out = {}
    for p in PROMPTS:
        r = http.post("/v1/completions", json=body(p, LONG_TOKENS))
        assert r.status_code == 200, r.text
        out[p] = r.json()["choices"][0]["text"]
    return out


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 5}], ids=["greedy", "seeded"])
def test_a_decode_engine_killed_mid_stream_the_stream_goes_on_token_exact(http, undisturbed, sampling):
    req = body(PROMPTS[0], LONG_TOKENS, **sampling)
    want = (
        undisturbed[PROMPTS[0]] if not sampling else http.post("/v1/completions", json=req).json()["choices"][0]["text"]
    )
    killed: list[str] = []

    def on_event(n: int) -> None:
        if n == 10:
            killed.append(kill_when_busy(DECODE))

    text, usage = stream_text(http, req, on_event)
    assert killed
    assert text == want
    assert usage["completion_tokens"] == LONG_TOKENS
    wait_healthy(http)
    report(
        "decode killed mid-stream", requests=1, streamed=True, sampling=sampling or "greedy", killed=killed, equal=True
    )


def test_a_decode_engine_killed_during_a_whole_response_it_is_still_exact(http, undisturbed):
    result: dict[str, Any] = {}

    def post() -> None:
        result["r"] = http.post("/v1/completions", json=body(PROMPTS[1], LONG_TOKENS))

    t = threading.Thread(target=post)
    t.start()
    killed = kill_when_busy(DECODE)
    t.join(TIMEOUT_S)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == undisturbed[PROMPTS[1]]
    assert r.json()["usage"]["completion_tokens"] == LONG_TOKENS
    wait_healthy(http)
    report("decode killed, whole response", requests=1, streamed=False, killed=killed, equal=True)


def test_a_decode_engine_dead_before_the_hand_over_leaves_no_kv_held_at_the_prefill_engine(http, undisturbed):
    """The prefill side holds a request's KV until the decode side reads it or a lease ends; a
    decode engine that is already dead never will, so the router frees it when it moves on."""
    ray.kill(engine(DECODE[0]))
    # Round robin: of two requests sent at once, one is handed to the dead engine (its
    # replacement takes seconds) and goes on on the other; the KV lease is 5 s.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda p: http.post("/v1/completions", json=body(p, 16)), PROMPTS[:2]))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    for p, r in zip(PROMPTS[:2], responses, strict=True):
        assert undisturbed[p].startswith(r.json()["choices"][0]["text"])
    prefill = ray.get(engine("raypd-prefill-0").stats.remote())
    assert prefill.extra["held_for_decode"] == 0
    assert prefill.num_blocks_free == prefill.num_blocks_total
    wait_healthy(http)
    report("decode dead before the hand-over", requests=2, ok=2, prefill_blocks_held=0)


def test_the_prefill_engine_killed_with_requests_in_flight(server, http, undisturbed):
    n = 12

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as c:
            reqs = [c.post("/v1/completions", json=body(PROMPTS[i % 3], LONG_TOKENS)) for i in range(n)]
            return await asyncio.gather(*reqs)

    killer = threading.Thread(target=kill_when_busy, args=(("raypd-prefill-0",),))
    killer.start()
    responses = asyncio.run(main())
    killer.join()
    assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses if r.status_code != 200]
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == [undisturbed[PROMPTS[i % 3]] for i in range(n)]
    wait_healthy(http)
    report("prefill killed in flight", requests=n, ok=n, equal=True)


def test_100_clients_dropping_mid_stream_leave_no_block_behind(server, http):
    """No engine is killed here, so none may look lost: no request resumed elsewhere, no engine
    replaced. A dropped request once took its engine's other requests with it (Ray cancelled the
    shared output poller's call with the dropped request's task, actors/client.py `_unowned`):
    they were resumed, and those that found no engine before their migration deadline were a 503
    "engine restarting". A supervisor that replaced an engine Ray could not reach for a moment
    (until serve/engines.py `engine_dead`) would end the same way."""
    n = 100
    resumed_before, engines_before = resumed(http), incarnations()

    async def one(c: httpx.AsyncClient, i: int) -> int | str:
        req = {**body(PROMPTS[i % 3], LONG_TOKENS), "stream": True}
        async with c.stream("POST", "/v1/completions", json=req) as r:
            if r.status_code != 200:
                return f"{r.status_code} {(await r.aread()).decode()}"
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 1 + i % 4:
                    break  # leave mid-stream: the server must abort the request
            return 200

    async def main() -> list[int | str]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    statuses = asyncio.run(main())
    assert statuses == [200] * n, [s for s in statuses if s != 200]
    wait_healthy(http)
    assert resumed(http) == resumed_before, "requests were resumed elsewhere, yet no engine was killed"
    assert incarnations() == engines_before, "an engine was replaced, yet none was killed"
    report("clients dropping mid-stream", requests=n, dropped=n, resumed=0, replaced=0)


def test_overload_at_3x_capacity_every_request_is_served_or_refused_with_retry_after(server, http):
    n = 3 * CAPACITY
    # Long requests: with short ones the engines finished them about as fast as Serve's proxy
    # handed them over, the ingress never held CAPACITY at once and nothing was refused.
    tokens = LONG_TOKENS

    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S, limits=limits) as c:
            return await asyncio.gather(
                *(c.post("/v1/completions", json=body(PROMPTS[i % 3], tokens)) for i in range(n))
            )

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == n, [r.text for r in responses if r.status_code not in (200, 503)]
    assert ok and refused
    assert all(r.headers.get("Retry-After") for r in refused)
    not_openai = [(r.headers, r.text) for r in refused if not r.text.startswith('{"error"')]
    assert not not_openai, not_openai[:3]
    assert all(r.json()["error"]["type"] == "service_unavailable_error" for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == tokens for r in ok)
    wait_healthy(http)
    report("overload 3x", requests=n, ok=len(ok), refused_503=len(refused), lost=0)
