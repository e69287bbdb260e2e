"""Bad days over real HTTP (1P1D on Ray Serve): a worker fault fails only the requests of that
step, and an engine killed with `ray.kill` is replaced and serves again."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import ray

from actors.ports import free_port
from engine.config import Config
from serve.engines import NAMESPACE
from tests.api.conftest import deployed

PROMPT = "t3 t14 t15 t92 t65 t35"
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(ray_cluster, checkpoint):
    cfg = Config(
        model=checkpoint,
        served_model_name="tiny",
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
        max_model_len=512,
        max_num_seqs=16,
        worker_threads=1,
        port=free_port(),
        prefill=1,
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def decode_engine():
    return ray.get_actor("raypd-decode-0", namespace=NAMESPACE)


def test_a_worker_fault_mid_stream_fails_that_stream_only(http):
    want = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    events = []
    with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 400, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                ray.get(decode_engine().inject_worker_faults.remote(1))
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and "injected worker fault" in errors[0]["message"], events[-3:]
    assert events[-1] == "[DONE]"
    again = http.post("/v1/completions", json=BODY)  # the engine kept serving
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
    stats = ray.get(decode_engine().wait_idle.remote())
    assert stats.num_blocks_free == stats.num_blocks_total


def test_a_killed_decode_engine_is_replaced_within_30s(http):
    want = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    ray.kill(decode_engine())
    start = time.monotonic()
    statuses = []
    while time.monotonic() - start < 30:
        r = http.post("/v1/completions", json=BODY)
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
        time.sleep(0.2)
    assert statuses[-1] == 200, statuses
    assert r.json()["choices"][0]["text"] == want
    assert http.get("/health").status_code == 200
    for name in ("raypd-prefill-0", "raypd-decode-0"):
        stats = ray.get(ray.get_actor(name, namespace=NAMESPACE).wait_idle.remote())
        assert stats.num_blocks_free == stats.num_blocks_total
