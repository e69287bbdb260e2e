"""Schemathesis against the app's own `/openapi.json`: requests generated from the schema, valid
ones and ones that break it (negative mode), sent over real HTTP to the app served by uvicorn
in this process over an in-process engine (no Ray). None may get a 5xx.

The schema states each field's real range, so the valid requests probe the edges the engine
must serve and the negative ones the values the API must refuse. Bounded: a fixed number of
examples per route, no deadline (a valid request runs the model), each request within a
timeout, hypothesis seeded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from actors.ports import free_port
from api import Engine, RoundRobinRouter, create_app
from engine.config import Config
from engine.local import build_local_engine

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
EXAMPLES = 200  # the four routes, positive and negative
SEED = 8
REQUEST_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The app on uvicorn in a thread, its engine in the same event loop (as in a Serve replica)."""
    cfg = Config(
        model=str(MODEL_DIR),
        served_model_name="tiny-hybrid",
        device="cpu",
        num_kv_blocks=512,
        max_model_len=256,
        max_num_seqs=32,
        worker_threads=1,
    )
    core, worker = build_local_engine(cfg)
    app = create_app(cfg, RoundRobinRouter([Engine.local("e0", core)]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    async def serve() -> None:
        try:
            await server.serve()  # its lifespan closes the router on the way out
        finally:
            await core.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=START_TIMEOUT_S)
        worker.close()


def test_generated_requests_never_get_a_server_error(base_url: str) -> None:
    routes = r"^(/v1/(chat/)?completions|/(de)?tokenize)$"
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json").include(path_regex=routes)
    cases = st.one_of([api.as_strategy(generation_mode=mode) for mode in GenerationMode])
    statuses: Counter[int] = Counter()

    @given(case=cases)
    @seed(SEED)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def no_server_error(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    no_server_error()
    # Both kinds came through: requests the engine served and requests the API refused.
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0, statuses
