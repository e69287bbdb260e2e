"""The real server: Ray Serve on a local cluster, HTTP on a free port, driven by the official
`openai` package and by raw HTTP for what a well-behaved client never sends."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from actors.client import EngineCalls, EngineClient
from actors.ports import free_port
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import SamplingParams
from tests.api.conftest import deployed

KEY = "sk-test"
MODEL = "tiny"
PROMPT = "t3 t14 t15 t92 t65 t35"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module", params=[0, 1], ids=["colocated", "1P1D"])
def server(ray_cluster, checkpoint, request):
    cfg = Config(
        model=checkpoint,
        served_model_name=MODEL,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=512,
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        worker_threads=1,
        api_key=KEY,
        port=free_port(),
        prefill=request.param,
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def engine_stats(server):
    """The stats of the engine that streams tokens (the decode engine under PD)."""
    return ray.get(list(server.engines.values())[-1].stats.remote())


def wait_blocks_free(server, within_s: float = 2.0) -> float:
    """Until every engine (prefill and decode) has all its blocks back."""
    start = time.monotonic()
    while True:
        stats = ray.get([h.stats.remote() for h in server.engines.values()])
        if all(s.num_blocks_free == s.num_blocks_total for s in stats):
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"blocks still in use: {stats}"
        time.sleep(0.05)


def wait_aborted_early(server, steps_at_drop: int, tokens_left: int) -> None:
    """Until the dropped request's blocks are back, then check the engine stopped it: a
    request that ran to its end instead would have taken a step per token left. The bound is
    loose because a loaded 2-core machine can take seconds to pass the abort on."""
    wait_blocks_free(server, within_s=30.0)
    steps = engine_stats(server).extra["steps"] - steps_at_drop
    assert steps < tokens_left, f"the engine ran {steps} more steps: the request was never aborted"


def engine_greedy(cfg: Config, prompt: list[int], n: int) -> list[int]:
    """The same request on an in-process engine built from the same config."""

    async def main():
        core, worker = build_local_engine(cfg)
        client = EngineClient(EngineCalls.local(core))
        ids = [
            t
            for out in [o async for o in client.generate(prompt, SamplingParams(n, 0.0, ignore_eos=True))]
            for t in out.new_token_ids
        ]
        await client.close()
        await core.close()
        worker.close()
        return ids

    return asyncio.run(main())


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_tokenize_round_trips_and_counts_what_generation_runs_on(server, http):
    ids = [int(w[1:]) for w in PROMPT.split()]
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r == {"count": 6, "max_model_len": 512, "tokens": ids, "token_strs": PROMPT.split()}
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": PROMPT}
    messages = [{"role": "user", "content": PROMPT}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat["tokens"] == ids and chat["count"] == usage["prompt_tokens"]
    assert http.get("/tokenizer_info").json()["model_max_length"] == 512
    for path, body, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "messages"),
        ("/tokenize", {"prompt": PROMPT, "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"prompt": PROMPT, "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
        ("/detokenize", {"tokens": [96]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ]:
        bad = http.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert http.post("/tokenize", json={"model": "other", "prompt": PROMPT}).status_code == 404
    assert httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).status_code == 401  # no key


def test_completion_is_the_engines_greedy_output(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    ids = [int(w[1:]) for w in PROMPT.split()]
    expected = engine_greedy(server.cfg, ids, 12)
    assert r.choices[0].text.split() == [f"t{i}" for i in expected]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    assert as_ids.choices[0].text == r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 12, 18)


def test_streamed_completion_equals_whole_and_counts_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed(client):
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert whole.choices[0].message.content == completion.choices[0].text  # built-in template: the content
    assert whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (6, 8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY).choices[0].text
    words = full.split()
    stop = f" {words[4]}"
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=stop, **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    # The engine ran until the token that completed the stop string, and usage says so.
    assert r.usage.completion_tokens == len(expected.split()) + 1
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop, "zzz"], stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


def test_twenty_concurrent_streams_complete(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        async def one(i):
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=f"t{i + 1} t{i + 2}",
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0.7,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            return [c async for c in stream]

        try:
            return await asyncio.gather(*(one(i) for i in range(20)))
        finally:
            await aclient.close()

    for chunks in asyncio.run(main()):
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 16
    wait_blocks_free(server)


BAD_BODIES = [
    ({"prompt": "t1", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "t1", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "t1", "temperature": 2.5}, "temperature"),
    ({"prompt": "t1", "temperature": "hot"}, "temperature"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": " ".join(["t1"] * 500), "max_tokens": 100}, "max_tokens"),  # beyond the 512-token context
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "t1"}]}, "messages"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES)
def test_invalid_values_are_400(http, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_malformed_json_unknown_model_and_bad_key(server, http, client):
    r = http.post(
        "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="t1", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "t1"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # An unknown field is refused by name, and the server still serves after all of the above.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "t1", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "t1", "max_tokens": 2, "user": "u"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_dropped_stream_frees_its_blocks(server, http):
    aborted = metric(http, "raypd_requests_total", outcome="aborted")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
            if len(got) == 3:
                break
        stats = engine_stats(server)
        assert stats.num_running == 1 and stats.num_blocks_free < stats.num_blocks_total
    assert all(c["choices"][0]["finish_reason"] is None for c in got)
    wait_blocks_free(server, within_s=2.0)
    assert metric(http, "raypd_requests_total", outcome="aborted") == aborted + 1


def test_a_dropped_stream_leaves_the_others_on_its_engine_alone(server, http):
    """Serve cancels a dropped request's task and, with it, the Ray calls that task made: the
    engine's shared output poller must not be one of them, or every other request on the
    engine would take it for lost and be resumed elsewhere."""
    resumed = metric(http, "raypd_requests_resumed_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # its poller is running now
        with http.stream("POST", "/v1/completions", json=body) as second:
            events = (line for line in second.iter_lines() if line.startswith("data: "))
            next(events)
            first.close()  # the first client leaves; the second reads to the end
            rest = list(events)
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert metric(http, "raypd_requests_resumed_total") == resumed


def test_dropped_request_frees_its_blocks(server, http):
    aborted = metric(http, "raypd_requests_total", outcome="aborted")
    steps = engine_stats(server).extra["steps"]
    # As many tokens as the context allows, and a client that gives up well before they could
    # be made: the shipped model decodes a token in ~1 ms on one core, 400 of them in < 0.5 s.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.1)
    # Under load the server may notice the request only after the client gave up: wait for
    # it to count the abort, then for the engine to stop the request.
    deadline = time.monotonic() + 10
    while metric(http, "raypd_requests_total", outcome="aborted") < aborted + 1:
        assert time.monotonic() < deadline, "the dropped request was never aborted"
        time.sleep(0.05)
    wait_aborted_early(server, steps, 480)
    assert metric(http, "raypd_requests_total", outcome="aborted") == aborted + 1


def metric(http, name, **labels) -> float:
    text = http.get("/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_parse_and_idle_engine_uses_no_blocks(server, http):
    wait_blocks_free(server)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert all(s.value == 0 for s in families["raypd_kv_blocks_in_use"].samples)
    capacity = {s.labels["engine"]: s.value for s in families["raypd_kv_blocks_capacity"].samples}
    assert set(capacity) == set(server.engines)
    assert capacity[list(server.engines)[-1]] == engine_stats(server).num_blocks_total
    assert metric(http, "raypd_requests_total", outcome="success") > 0
    assert metric(http, "raypd_requests_total", outcome="rejected") > 0
    assert metric(http, "raypd_time_to_first_token_seconds_count") > 0
    assert metric(http, "raypd_generation_tokens_total") > 0
    assert http.get("/health").status_code == 200


def test_metrics_break_requests_down_by_phase_and_count_kv_transfers(server, http):
    """Every engine times the phases of the requests it finished; under PD the decode engine
    counts its NIXL loads (pages, bytes, time) and none failed."""
    wait_blocks_free(server)
    decode = list(server.engines)[-1]
    for name in server.engines:
        assert metric(http, "raypd_request_queue_time_seconds_count", engine=name) > 0
        assert metric(http, "raypd_request_prefill_time_seconds_count", engine=name) > 0
    assert metric(http, "raypd_request_decode_time_seconds_count", engine=decode) > 0
    loads = metric(http, "raypd_kv_transfer_seconds_count", engine=decode)
    if server.cfg.colocated:
        assert loads == 0 and metric(http, "raypd_kv_transfer_bytes_total") == 0
        return
    prefill = next(iter(server.engines))
    assert metric(http, "raypd_request_decode_time_seconds_count", engine=prefill) == 0  # it hands over
    assert loads > 0
    assert metric(http, "raypd_kv_transfer_seconds_bucket", engine=decode, le="+Inf") == loads
    descriptors = metric(http, "raypd_kv_transfer_descriptors_total", engine=decode)
    assert descriptors >= loads
    assert metric(http, "raypd_kv_transfer_bytes_total", engine=decode) % descriptors == 0
    assert metric(http, "raypd_kv_transfer_failed_total", engine=decode) == 0
    assert metric(http, "raypd_kv_lease_expired_total", engine=decode) == 0


def test_the_service_runs_at_normal_priority(server):
    """Ray starts worker processes at nice 15. The engines, their workers and the API replica
    ask for 0 wherever they run (serve/placement.py); a cluster raypd starts, as this one runs,
    starts every worker at 0, Serve's proxy included (serve/launch.py, QUIET_LOCAL_CLUSTER)."""
    nice: dict[str, set[int]] = {}
    for actor in ray._private.state.actors(actor_state_name="ALIVE").values():
        kind = actor["ActorClassName"].split(":")[0]  # Serve names its replicas' classes per app
        nice.setdefault(kind, set()).add(os.getpriority(os.PRIO_PROCESS, actor["Pid"]))
    for kind in ("EngineActor", "WorkerActor", "ServeReplica", "ProxyActor"):
        assert nice[kind] == {0}, kind


@ray.remote(num_cpus=0)
class _Niceness:
    def get(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)


def test_an_actors_runtime_env_sets_its_niceness(ray_cluster):
    """What serve/placement.py's NORMAL_PRIORITY relies on, on a cluster raypd did not start
    (whose workers Ray starts at 15): the variable in an actor's runtime_env sets its process's
    niceness. Here the cluster's default is 0, so the check asks for 15 instead."""
    actor = _Niceness.options(runtime_env={"env_vars": {"RAY_worker_niceness": "15"}}).remote()
    try:
        assert ray.get(actor.get.remote(), timeout=60) == 15
    finally:
        ray.kill(actor)
