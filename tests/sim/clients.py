"""The clients of a simulated run: one coroutine per request, as api/router.py would drive
the engines, leaving at the request's abort point.

PD: submit to the prefill engine with `do_remote_decode`, pass its `kv_transfer_params` to
the decode engine and stream the tokens; a client that leaves before the decode engine
answered also frees the prefill side, as `PDRouter` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from actors.client import EngineClient
from engine.messages import RequestOutput, SamplingParams
from tests.sim.workload import RequestSpec


@dataclass(slots=True)
class Outcome:
    req_id: str
    arrival_s: float = 0.0
    finish: str = "pending"  # a finish reason, "client-left", "rejected", "timeout", "cancelled"
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    handed_over_at: float | None = None
    params: dict[str, Any] | None = None  # a prefill engine's answer
    ended_at: float | None = None


class Tally:
    """Tokens delivered to every client: the watchdog's progress signal."""

    def __init__(self) -> None:
        self.tokens = 0
        self.ended = 0


def sampling(spec: RequestSpec) -> SamplingParams:
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=False)


async def _drain(
    stream: AsyncIterator[RequestOutput], outcome: Outcome, tally: Tally, stop_after: int | None = None
) -> bool:
    """Collect outputs until a finish reason (True) or `stop_after` tokens (False: the client
    leaves, which aborts the request)."""
    async for out in stream:
        outcome.tokens.extend(out.new_token_ids)
        if out.kv_transfer_params is not None:
            outcome.params = out.kv_transfer_params
        tally.tokens += len(out.new_token_ids)
        if out.finish_reason is not None:
            outcome.finish, outcome.error = out.finish_reason, out.error
            return True
        if stop_after is not None and len(outcome.tokens) >= stop_after:
            return False
    return True


async def _leave_after(task: asyncio.Task[object], delay_s: float) -> bool:
    """True if the task ended within `delay_s`; else the client leaves (the task is cancelled)."""
    done, _ = await asyncio.wait({task}, timeout=delay_s)
    if done:
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def colocated_request(spec: RequestSpec, engine: EngineClient, outcome: Outcome, tally: Tally) -> None:
    await asyncio.sleep(spec.arrival_s)
    await _drain(engine.generate(spec.prompt, sampling(spec), spec.req_id), outcome, tally)


async def pd_request(
    spec: RequestSpec,
    prefill: EngineClient,
    decode: EngineClient,
    posted: asyncio.Event,
    outcome: Outcome,
    tally: Tally,
) -> None:
    """`posted` is set when the decode worker posts this request's READ."""
    await asyncio.sleep(spec.arrival_s)
    abort = spec.abort
    hand = Outcome(spec.req_id, spec.arrival_s)
    task = asyncio.create_task(
        _drain(prefill.generate(spec.prompt, sampling(spec), spec.req_id, do_remote_decode=True), hand, Tally())
    )
    if abort is not None and abort.point == "before_prefill" and not await _leave_after(task, abort.delay_s):
        outcome.finish = "client-left"
        return
    await task
    if hand.params is None:  # the prefill engine refused or failed the request
        outcome.finish, outcome.error, outcome.tokens = hand.finish, hand.error, hand.tokens
        return
    outcome.handed_over_at = asyncio.get_running_loop().time()
    if abort is not None and abort.point in ("before_prefill", "between"):
        await prefill.abort(spec.req_id)  # nobody will read the prefill side's blocks
        outcome.finish = "client-left"
        return
    stop_after = abort.after_tokens if abort is not None and abort.point == "mid_decode" else None
    stream = decode.generate(spec.prompt, sampling(spec), spec.req_id, kv_transfer_params=hand.params)
    task = asyncio.create_task(_drain(stream, outcome, tally, stop_after))
    try:
        left = False
        if abort is not None and abort.point in ("queued", "mid_load"):
            if abort.point == "mid_load":
                await _until_either(task, posted)
            left = not await _leave_after(task, abort.delay_s)
        if left or not await task:
            outcome.finish = "client-left"
    finally:
        if not task.done():  # this client is being cancelled (a hang): stop reading first
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()  # leaving early aborts the request (EngineClient.generate)
    if outcome.finish == "client-left" and not outcome.tokens:
        await prefill.abort(spec.req_id)  # as PDRouter: left before the decode engine answered


async def _until_either(task: asyncio.Task[bool], event: asyncio.Event) -> None:
    waiter = asyncio.create_task(event.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
