"""A decode engine with only KV loads to poll looks again soon, then less often (engine/core.py
`PollPause`): the pauses double from the first up to the longest, and start short again once a
step computes a token. The engine runs a real decode-side scheduler whose load ends after a
chosen number of polling steps; the pauses are recorded, not slept, so nothing races a clock."""

from __future__ import annotations

import asyncio

import pytest

from engine.core import EngineCore, PollPause
from engine.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from tests.engine.test_pd import decode_scheduler, remote


def test_pauses_double_up_to_the_longest_and_reset():
    pause = PollPause(first=0.001, longest=0.005)
    assert [pause.take() for _ in range(5)] == [0.001, 0.002, 0.004, 0.005, 0.005]
    pause.reset()
    assert pause.take() == 0.001


class _Recorded:
    """The engine's pause, with each call written down and no time slept."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reset(self) -> None:
        self.calls.append("reset")

    def take(self) -> float:
        self.calls.append("take")
        return 0.0


@pytest.mark.parametrize("polls", [1, 5])
def test_engine_pauses_only_while_polling_and_resets_on_a_computed_step(polls):
    sent: list[SchedulerOutput] = []

    async def step(out: SchedulerOutput) -> ModelRunnerOutput:
        sent.append(out)
        # The load's first step posts the READ; it lands with the `polls`-th polling step after.
        landed = ["d"] if len(sent) == polls + 1 else []
        return ModelRunnerOutput(out.step_id, dict.fromkeys(out.num_scheduled_tokens, 7), finished_recving=landed)

    async def main() -> list[str]:
        core = EngineCore(decode_scheduler(), [step], False, None)
        core.poll_pause = recorded = _Recorded()  # type: ignore[assignment]
        core.add_request("d", list(range(10)), SamplingParams(max_tokens=3, temperature=0), remote("d", 9))
        tokens = []
        while True:
            for batch in await core.get_outputs(timeout=10):
                for out in batch:
                    tokens += out.new_token_ids
                    if out.finish_reason is not None:
                        await core.close()
                        assert tokens == [7, 7, 7]
                        return recorded.calls

    calls = asyncio.run(main())
    # The READ's step and each polling step compute nothing; the load's last token does.
    assert calls[: polls + 1] == ["take"] * (polls + 1)
    assert set(calls[polls + 1 :]) == {"reset"}
