"""A load ramp (low, high, low) over 1P1D with autoscaling between one and two engines a side:
each side scales up under the high load and back down after it, with every request answered
and equal to its undisturbed output. Engines are slowed by the stream-delay knob, and the
targets are set low so that the high phase is above them and a trickle well below; nothing is
timed: each phase lasts until the controller reports the scale events it waits for."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray

from tests.scaling.conftest import (
    TIMEOUT_S,
    Outcome,
    body,
    config,
    controller,
    deployed,
    stream,
    wait_idle_everywhere,
)

pytestmark = pytest.mark.scaling

# High: long prompts (the prefill engine's queue grows, 64 tokens a step) with short outputs.
LONG = [";".join(f"k{j}={(i * 31 + j * 7) % 1000:03d}" for j in range(24)) + ";?k3=" for i in range(8)]
LONG_TOKENS = 16
SHORT = "ab=381;qe=027;?qe="  # low: one short request at a time, a block or two of KV
SHORT_TOKENS = 4
WORKERS = 24
PHASE_LIMIT_S = 240.0  # a phase that never sees its scale events fails instead of hanging


@pytest.fixture(scope="module")
def server(ray_cluster):
    cfg = config(
        max_num_batched_tokens=64,
        enable_prefix_caching=False,  # every long prompt is computed again: the prefill queue grows
        prefill=1,
        decode=1,
        max_prefill=2,
        max_decode=2,
        # Prefill: more than one request waiting per engine is too many. Decode: 2% of the KV in
        # use is too much (a short request holds under half of that, a long one more). Latency
        # targets out of the way: they depend on the machine.
        scale_prefill_waiting=1,
        scale_prefill_ttft_ms=600_000,
        scale_decode_itl_ms=600_000,
        scale_decode_kv_percent=2,
        scale_up_delay_s=1,
        scale_down_delay_s=3,
        drain_timeout_s=60,
    )
    with deployed(cfg) as dep:
        yield dep


def _events() -> set[tuple[str, str]]:
    return {(e.role, e.direction) for e in ray.get(controller().scale_events.remote())}


async def _until(client, want, prompts, max_tokens, workers, outcomes) -> None:
    """Keep `workers` clients sending `prompts` in turn until the controller has made every
    scale event in `want`; every outcome is kept."""
    done = asyncio.Event()

    async def worker(k: int) -> None:
        i = k
        while not done.is_set():
            prompt = prompts[i % len(prompts)]
            outcomes.append((prompt, await stream(client, body(prompt, max_tokens), Outcome())))
            i += workers

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PHASE_LIMIT_S
        while not want <= _events():
            assert loop.time() < deadline, f"no {want - _events()} after {PHASE_LIMIT_S} s"
            await asyncio.sleep(0.5)
        done.set()

    tasks = [asyncio.ensure_future(worker(k)) for k in range(workers)]
    try:
        await watch()
    finally:
        done.set()
        await asyncio.gather(*tasks)


def test_a_load_ramp_scales_each_side_up_and_back_down_with_no_failed_request(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            expected = {}
            for p, n in [*((p, LONG_TOKENS) for p in LONG), (SHORT, SHORT_TOKENS)]:  # low: one at a time
                r = await client.post("/v1/completions", json=body(p, n))
                assert r.status_code == 200, r.text
                expected[p] = r.json()["choices"][0]["text"]
            outcomes: list[tuple[str, Outcome]] = []
            await _until(client, {("prefill", "up"), ("decode", "up")}, LONG, LONG_TOKENS, WORKERS, outcomes)
            high = len(outcomes)
            await _until(client, {("prefill", "down"), ("decode", "down")}, [SHORT], SHORT_TOKENS, 1, outcomes)
            return expected, outcomes, high

    expected, outcomes, high = asyncio.run(main())
    assert high >= WORKERS and len(outcomes) > high
    failed = [(p, o.error) for p, o in outcomes if o.error is not None]
    assert failed == []
    assert all(o.text == expected[p] for p, o in outcomes)
    events = ray.get(controller().scale_events.remote())
    assert sorted((e.role, e.direction) for e in events) == [
        ("decode", "down"),
        ("decode", "up"),
        ("prefill", "down"),
        ("prefill", "up"),
    ]
    engines = ray.get(controller().engine_set.remote())
    assert (len(engines.prefill), len(engines.decode)) == (1, 1)
    for name, stats in wait_idle_everywhere().items():
        assert stats.num_blocks_free == stats.num_blocks_total, name
