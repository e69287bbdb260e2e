"""Resuming a request whose engine is lost (api/migration.py): the bookkeeping, and two
in-process colocated engines of which one fails under a running request (its worker is
closed, so its step loop fails as when a worker process dies)."""

from __future__ import annotations

import asyncio

import pytest

from actors.client import EngineLostError
from api import Engine, RoundRobinRouter
from api.migration import MigrationPolicy, Progress
from engine.config import Config
from engine.local import build_local_engine
from engine.messages import RequestOutput, SamplingParams
from tests.api.test_app_local import config

PROMPT = [3, 14, 15, 92, 65, 35]


def test_progress_turns_sent_tokens_into_prompt_and_keeps_the_client_counts():
    p = Progress(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, stop=("x",)))
    assert p.resume() == (PROMPT, p.sampling)
    first = p.account(RequestOutput("r", [7, 8], None, None, 6, 2), "r")
    assert first.num_output_tokens == 2
    prompt, sampling = p.resume()
    assert prompt == [*PROMPT, 7, 8]
    assert sampling.max_tokens == 8 and sampling.stop == ("x",) and sampling.temperature == 0.0
    assert sampling.random_offset == 0  # greedy: no random stream to advance
    last = p.account(RequestOutput("r-r1", [9], None, "length", 8, 8), "r")
    assert (last.req_id, last.num_prompt_tokens, last.num_output_tokens) == ("r", 6, 10)
    assert p.sent == [7, 8, 9]
    seeded = Progress(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    seeded.account(RequestOutput("r", [7, 8], None, None, 6, 2), "r")
    seeded.resume()
    assert seeded.resume()[1].random_offset == 2


def test_a_resumed_request_keeps_its_penalties_history_and_min_tokens():
    sampling = SamplingParams(max_tokens=10, min_tokens=4, presence_penalty=1.0, prompt_logprobs=2)
    p = Progress(PROMPT, sampling)
    p.account(RequestOutput("r", [7, 8, 9], None, None, 6, 3), "r")
    prompt, resumed = p.resume()
    assert prompt == [*PROMPT, 7, 8, 9]
    assert (resumed.max_tokens, resumed.min_tokens, resumed.num_prior_outputs) == (7, 1, 3)
    assert resumed.presence_penalty == 1.0 and resumed.prompt_logprobs is None  # sent with the first output
    p.account(RequestOutput("r-r1", [5, 6], None, None, 9, 2), "r")
    assert p.resume()[1].num_prior_outputs == 5 and p.resume()[1].min_tokens == 0


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def cut_after_three(
    cfg: Config, prompt: list[int], sampling: SamplingParams
) -> tuple[list[RequestOutput], list[RequestOutput], int]:
    """Two colocated engines: the request run undisturbed on e0, then again on e1, whose
    worker is closed after three outputs; the outputs of both and the router's resumptions."""

    async def main() -> tuple[list[RequestOutput], list[RequestOutput], int]:
        (core0, worker0), (core1, worker1) = build_local_engine(cfg), build_local_engine(cfg)
        router = RoundRobinRouter([Engine.local("e0", core0), Engine.local("e1", core1)])
        try:
            whole = [o async for o in router.generate(prompt, sampling, "undisturbed")]  # on e0
            cut: list[RequestOutput] = []
            async for out in router.generate(prompt, sampling, "cut"):  # on e1
                cut.append(out)
                if len(cut) == 3:
                    worker1.close()  # e1's next step fails: its loop ends every request
            return whole, cut, router.num_resumed
        finally:
            await router.close()
            await core0.close()
            await core1.close()
            worker0.close()

    return asyncio.run(main())


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=21, ignore_eos=True),
        SamplingParams(
            max_tokens=48,
            temperature=0.9,
            seed=21,
            ignore_eos=True,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            min_p=0.05,
            logprobs=True,
            top_logprobs=2,
            prompt_logprobs=1,
        ),
    ],
    ids=["greedy", "seeded", "penalized"],
)
def test_a_colocated_engine_failing_mid_request_is_resumed_on_the_other_token_exact(checkpoint, sampling):
    whole, cut, resumed = cut_after_three(config(checkpoint), PROMPT, sampling)
    assert resumed >= 1
    assert _tokens(cut) == _tokens(whole) and len(_tokens(cut)) == 48
    assert cut[-1].finish_reason == "length" and cut[-1].num_output_tokens == 48
    assert cut[-1].num_prompt_tokens == len(PROMPT) and {o.req_id for o in cut} == {"cut"}
    if sampling.logprobs:  # the same logprobs and alternatives across the break; the prompt's once
        assert [lp for o in cut for lp in o.logprobs or ()] == pytest.approx(
            [lp for o in whole for lp in o.logprobs or ()], abs=1e-5
        )
        assert [[t for t, _ in top] for o in cut for top in o.top_logprobs or ()] == [
            [t for t, _ in top] for o in whole for top in o.top_logprobs or ()
        ]
        assert [o.prompt_logprobs for o in cut if o.prompt_logprobs] == [whole[0].prompt_logprobs]


def test_without_migration_the_lost_engine_is_the_clients_error(checkpoint):
    cfg = config(checkpoint)

    async def main() -> list[RequestOutput]:
        core, worker = build_local_engine(cfg)
        router = RoundRobinRouter([Engine.local("e0", core)], MigrationPolicy(timeout_s=0))
        got: list[RequestOutput] = []
        try:
            async for out in router.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0.0), "r"):
                got.append(out)
                worker.close()
        finally:
            await router.close()
            await core.close()
        return got

    try:
        asyncio.run(main())
    except EngineLostError as e:
        assert "engine failure" in str(e)
    else:
        raise AssertionError("the request went on without an engine")
