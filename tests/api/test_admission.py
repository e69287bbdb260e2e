"""The ingress bound (`--max-inflight`, api/limits.py `Admission`) in-process: past it a request
is refused at once with 503 and Retry-After, and every way a response ends gives its slots back."""

from __future__ import annotations

import asyncio

from api.limits import Admission
from tests.api.test_app_local import config, run

BODY = {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_slots_are_counted_per_choice_and_given_back_once():
    admission = Admission(4)
    first = admission.try_acquire(3)
    assert first is not None and admission.try_acquire(2) is None
    first.release()
    first.release()  # a response ending on two paths gives its slots back once
    assert admission.in_flight == 0
    assert admission.try_acquire(4) is not None and admission.in_flight == 4


def test_past_the_bound_503_with_retry_after_and_every_slot_comes_back(checkpoint):
    async def fn(c):
        burst = [c.post("/v1/completions", json={**BODY, "stream": i % 2 == 1, "n": 1 + i % 2}) for i in range(12)]
        responses = await asyncio.gather(*burst)
        refused_n = await c.post("/v1/completions", json={**BODY, "n": 5})  # can never fit: a 400
        # Takes every slot: it is served only if each response above gave its slots back.
        whole = await c.post("/v1/completions", json={**BODY, "n": 4})
        return responses, refused_n, whole

    responses, refused_n, whole = run(config(checkpoint, max_inflight=4), fn)
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
    assert refused_n.status_code == 400 and refused_n.json()["error"]["param"] == "n"
    assert whole.status_code == 200 and len(whole.json()["choices"]) == 4
