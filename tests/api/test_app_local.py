"""The API app in-process over an in-process engine (no Ray, no sockets): auth, overload,
several choices, logprobs, engine failures mid-stream, metrics."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api import Engine, RoundRobinRouter, create_app
from api.limits import MAX_BODY_BYTES
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import EngineOverloadedError, EngineStats, OutputBatch, RequestOutput

KEY = "sk-local"


def config(checkpoint: str, **kw) -> Config:
    return Config(
        model=checkpoint,
        served_model_name="tiny",
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=128,
        max_model_len=256,
        worker_threads=1,
        **kw,
    )


def run(cfg: Config, fn, core=None):
    """`fn(client)` against the app over a fresh engine (or `core`), inside one event loop."""

    async def main():
        local, worker = (core, None) if core is not None else build_local_engine(cfg)
        router = RoundRobinRouter([Engine.local("e0", local)])
        app = create_app(cfg, router)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://raypd") as client:
                return await fn(client)
        finally:
            await router.close()
            if worker is not None:
                await local.close()
                worker.close()

    return asyncio.run(main())


def events(text: str) -> list:
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_api_key_guards_v1_only(checkpoint):
    async def fn(c):
        body = {"model": "tiny", "prompt": "t1", "max_tokens": 2}
        missing = await c.post("/v1/completions", json=body)
        wrong = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        health = await c.get("/health")
        return missing, wrong, right, health

    missing, wrong, right, health = run(config(checkpoint, api_key=KEY), fn)
    for r in (missing, wrong):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert right.status_code == 200 and right.json()["usage"]["completion_tokens"] == 2
    assert health.status_code == 200


class OverloadedCore:
    """An engine whose waiting queue is always full."""

    def add_request(self, *args, **kw):
        raise EngineOverloadedError("1 requests are waiting; retry later")

    def abort(self, req_id):
        pass

    async def get_outputs(self, timeout=None):
        await asyncio.sleep(timeout or 0)
        return []

    def stats(self):
        return EngineStats(0, 1, 8, 8, 0, 0)


def test_full_queue_is_503_with_retry_after(checkpoint):
    async def fn(c):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "t1"}]}
        r = await c.post("/v1/chat/completions", json=body)
        return r, await c.get("/metrics")

    r, metrics = run(config(checkpoint), fn, core=OverloadedCore())
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "engine_overloaded"
    samples = {
        (s.name, s.labels.get("outcome")): s.value
        for f in text_string_to_metric_families(metrics.text)
        for s in f.samples
    }
    assert samples[("raypd_requests_total", "overloaded")] == 1


class FailingCore(OverloadedCore):
    """An engine that accepts a request, produces one token, then fails."""

    def __init__(self):
        self.outputs = []

    def add_request(self, req_id, ids, sampling, **kw):
        self.outputs = [
            RequestOutput(req_id, [5], None, None, len(ids), 1),
            RequestOutput(req_id, [], None, "error", len(ids), 1, error="worker died"),
        ]

    async def get_outputs(self, timeout=None):
        await asyncio.sleep(0.01)
        out, self.outputs = self.outputs, []
        return [OutputBatch(others=out)]


def test_engine_failure_mid_stream_ends_the_stream_with_an_error(checkpoint):
    async def fn(c):
        body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 8}
        streamed = await c.post("/v1/completions", json={**body, "stream": True})
        whole = await c.post("/v1/completions", json=body)
        return streamed, whole

    streamed, whole = run(config(checkpoint), fn, core=FailingCore())
    got = events(streamed.text)
    assert got[0]["choices"][0]["text"] == " t5"
    assert "worker died" in got[-1]["error"]["message"]
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"


def test_several_prompts_and_choices(checkpoint):
    async def fn(c):
        body = {
            "model": "tiny",
            "prompt": [[1, 2, 3], [4, 5]],
            "n": 2,
            "max_tokens": 4,
            "seed": 7,
            "ignore_eos": True,
            "logprobs": 0,
        }
        return (await c.post("/v1/completions", json=body)).json(), events(
            (
                await c.post(
                    "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
                )
            ).text
        )

    whole, chunks = run(config(checkpoint), fn)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    assert whole["choices"][0]["text"] != whole["choices"][1]["text"]  # each choice has its own seed
    for choice in whole["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
        assert all(x <= 0 for x in lp["token_logprobs"])
    texts = {
        i: "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i)
        for i in range(4)
    }
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}  # same seeds, same text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_chat_logprobs_and_max_completion_tokens(checkpoint):
    async def fn(c):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "t1 t2"}]}],
            "max_completion_tokens": 3,
            "logprobs": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        return (await c.post("/v1/chat/completions", json=body)).json()

    r = run(config(checkpoint), fn)
    content = r["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in content] == r["choices"][0]["message"]["content"].split()
    assert r["usage"]["completion_tokens"] == 3 and r["usage"]["prompt_tokens"] == 2


def test_metrics_parse_and_name_every_family(checkpoint):
    async def fn(c):
        await c.post("/v1/completions", json={"model": "tiny", "prompt": "t1 t2", "max_tokens": 3})
        await c.post("/v1/completions", json={"model": "tiny", "prompt": "t1", "max_tokens": -3})
        return (await c.get("/metrics")).text

    families = {f.name: f for f in text_string_to_metric_families(run(config(checkpoint), fn))}
    expected = {
        "raypd_requests",
        "raypd_time_to_first_token_seconds",
        "raypd_inter_token_latency_seconds",
        "raypd_e2e_request_latency_seconds",
        "raypd_prompt_tokens",
        "raypd_generation_tokens",
        "raypd_num_requests_running",
        "raypd_num_requests_waiting",
        "raypd_kv_blocks_in_use",
        "raypd_kv_blocks_capacity",
        "raypd_kv_blocks_zeroed",
        "raypd_kv_blocks_zero_skipped",
        "raypd_prefix_cache_queries",
        "raypd_prefix_cache_hits",
        "raypd_prefix_cache_loaded",
    }
    assert expected <= set(families)
    outcomes = {s.labels["outcome"]: s.value for s in families["raypd_requests"].samples if s.name.endswith("_total")}
    assert outcomes == {"success": 1, "rejected": 1}
    value = {
        f: families[f].samples[0].value
        for f in ("raypd_kv_blocks_capacity", "raypd_prompt_tokens", "raypd_generation_tokens")
    }
    assert value == {"raypd_kv_blocks_capacity": 128, "raypd_prompt_tokens": 2, "raypd_generation_tokens": 3}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [96]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "t1", "n": 0}, "n"),
        ({"prompt": "t1", "top_p": 0}, "top_p"),
        ({"prompt": "t1", "stop": [""]}, "stop"),
        ({"prompt": "t1", "logprobs": 9}, "logprobs"),
        ({"prompt": ["t1", [2]]}, "prompt"),
    ],
)
def test_more_invalid_values(checkpoint, body, param):
    async def fn(c):
        return await c.post("/v1/completions", json={"model": "tiny", **body})

    r = run(config(checkpoint), fn)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_body_beyond_the_limit_is_413_before_it_is_read_whole(checkpoint):
    """By its Content-Length, or, sent in chunks without one, once the chunks pass the bound;
    a body just within the bound reaches validation."""
    chunk = b" " * 2**20

    def chunks(n: int):
        async def gen():
            yield b'{"prompt": "t1", "max_tokens": 2'
            for _ in range(n):
                yield chunk
            yield b"}"

        return gen()

    async def fn(c):
        declared = await c.post(
            "/v1/completions", content=b" " * (MAX_BODY_BYTES + 1), headers={"Content-Type": "application/json"}
        )
        streamed = await c.post(
            "/v1/completions",
            content=chunks(MAX_BODY_BYTES // len(chunk)),
            headers={"Content-Type": "application/json"},
        )
        within = await c.post(
            "/v1/completions",
            content=chunks(MAX_BODY_BYTES // len(chunk) - 1),
            headers={"Content-Type": "application/json"},
        )
        return declared, streamed, within

    declared, streamed, within = run(config(checkpoint), fn)
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert within.status_code == 200 and within.json()["usage"]["completion_tokens"] == 2, within.text


def test_chat_uses_the_models_template(checkpoint, tmp_path):
    model_dir = tmp_path / "with-template"
    shutil.copytree(checkpoint, model_dir)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t9{% endif %}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))

    async def fn(c):
        body = {
            "model": "tiny",
            "messages": [{"role": "system", "content": "t1"}, {"role": "user", "content": "t2"}],
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
        }
        chat = (await c.post("/v1/chat/completions", json=body)).json()
        completion = (
            await c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "t1 t2 t9", "max_tokens": 2, "temperature": 0, "ignore_eos": True},
            )
        ).json()
        return chat, completion

    chat, completion = run(config(str(model_dir)), fn)
    assert chat["usage"]["prompt_tokens"] == 3
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


class RecordingCore(FailingCore):
    """An engine that finishes every request after one token, and remembers what it was given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def add_request(self, req_id, ids, sampling, **kw):
        self.seen.append(req_id)
        self.outputs.append(RequestOutput(req_id, [7], None, "length", len(ids), 1))


def test_round_robin_over_engines_and_per_engine_metrics(checkpoint):
    cores = [RecordingCore(), RecordingCore()]

    async def main():
        router = RoundRobinRouter([Engine.local(f"e{i}", core) for i, core in enumerate(cores)])
        app = create_app(config(checkpoint), router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://raypd") as c:
            for _ in range(4):
                r = await c.post("/v1/completions", json={"prompt": "t1", "max_tokens": 1})
                assert r.json()["choices"][0]["text"] == " t7"
            metrics = (await c.get("/metrics")).text
        await router.close()
        return metrics

    metrics = asyncio.run(main())
    assert [len(core.seen) for core in cores] == [2, 2]
    engines = {
        s.labels["engine"]
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "raypd_kv_blocks_capacity"
    }
    assert engines == {"e0", "e1"}
