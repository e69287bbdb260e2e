"""The scaling suite (`make test-scaling`): real engines on the shipped hybrid behind real Ray
Serve, engines added and drained under load, an ingress replica killed, `serve run`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from actors.ports import free_port
from engine.config import Config
from serve.controller import CONTROLLER_NAME
from serve.engines import NAMESPACE
from tests.api.conftest import deployed
from tests.ray_session import ray_session

__all__ = ["deployed"]

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
TIMEOUT_S = 120.0  # per request: a hang fails it instead of stalling the suite


@pytest.fixture(scope="session")
def shipped_model() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip("the shipped model models/tiny-hybrid is not built (make model)")
    return MODEL_DIR


@pytest.fixture(scope="module")
def ray_cluster(shipped_model: Path) -> Iterator[None]:
    with ray_session():
        yield


def config(**kw: Any) -> Config:
    """The shipped hybrid on CPU, steps slowed to 20 ms at least so that a stream lasts seconds."""
    base: dict[str, Any] = dict(
        model=str(MODEL_DIR),
        served_model_name="tiny",
        device="cpu",
        num_kv_blocks=512,
        max_model_len=512,
        max_num_seqs=32,
        worker_threads=1,
        port=free_port(),
        debug_stream_delay_ms=20,
    )
    return Config(**(base | kw))


def controller() -> Any:
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)


def engine(name: str) -> Any:
    return ray.get_actor(name, namespace=NAMESPACE)


def body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@dataclass
class Outcome:
    """One streamed request: its text, and the error that ended it early (None: it finished)."""

    text: str = ""
    events: int = 0
    error: str | None = None


def start_streams(client: httpx.AsyncClient, reqs: list[dict[str, Any]]) -> tuple[list[Outcome], list[asyncio.Task]]:
    """`stream` each request, concurrently: the outcomes as they progress, and their tasks."""
    outcomes = [Outcome() for _ in reqs]
    return outcomes, [asyncio.ensure_future(stream(client, r, o)) for r, o in zip(reqs, outcomes, strict=True)]


async def stream(client: httpx.AsyncClient, req: dict[str, Any], out: Outcome) -> Outcome:
    """Stream `req` into `out` (so a caller can watch it progress); an error is recorded, not
    raised: a status, an error event, or a connection that ended without `[DONE]`."""
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = f"error event: {event['error']}"
                    continue
                out.text += event["choices"][0]["text"]
                out.events += 1
            if not done and out.error is None:
                out.error = "the stream ended without [DONE]"
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e!r} after {out.events} events ({'with' if done else 'without'} [DONE])"
    return out


def wait_idle_everywhere() -> dict[str, Any]:
    """Every engine the controller serves with, once idle: its stats (blocks checked too)."""
    engines = ray.get(controller().engine_set.remote())
    names = [*engines.prefill, *engines.decode]
    stats = ray.get([engine(n).wait_idle.remote() for n in names], timeout=TIMEOUT_S)
    return dict(zip(names, stats, strict=True))
