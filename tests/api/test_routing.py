"""Routing policies and conditional disaggregation on engine states built from summaries
(api/routing/), and a router whose chosen engine dies between the decision and the call."""

from __future__ import annotations

import asyncio

import pytest

from api import ColocatedRouter, Engine
from api.routing.disagg import SATURATED_STEPS, decide
from api.routing.fleet import EngineState, Fleet
from api.routing.policies import RUNNING_WEIGHT, CacheAware, LeastLoaded, RoundRobin, expected_hit, make_policy
from api.routing.prefix import PromptBlocks
from engine.local import build_local_engine
from engine.messages import RequestOutput, SamplingParams
from engine.summary import EngineSummary, digest_of
from kv.block_hash import extend_block_hashes
from tests.api.test_app_local import config

BS = 4
SYSTEM = list(range(100, 132))  # 8 blocks shared by every prompt below
PROMPT = [*SYSTEM, 7, 8, 9, 10, 11]


def state(name, *, cached_prompt=(), waiting_tokens=0, running=0, waiting=0, free=1000, batch=64, role="decode"):
    cached = frozenset(digest_of(h) for h in extend_block_hashes([], list(cached_prompt), BS))
    s = EngineState(name, role)
    s.record(EngineSummary(running, waiting, waiting_tokens, free, 1000, BS, batch, 1, cached), polled_at=0.0)
    return s


def test_prompt_blocks_name_blocks_as_the_engines_cache_does():
    prompt = PromptBlocks(PROMPT)
    # At most len - 1 tokens can hit: the blocks of the first 36 of 37 tokens.
    assert len(prompt.digests(BS)) == (len(PROMPT) - 1) // BS
    held = state("a", cached_prompt=SYSTEM)
    assert expected_hit(held, prompt) == len(SYSTEM)
    # A cache holding a later block but not an earlier one gives no run past the gap.
    other = frozenset(digest_of(h) for h in extend_block_hashes([], [*[0] * 4, *SYSTEM[4:]], BS))
    assert prompt.hit_tokens(other, BS) == 0
    assert expected_hit(state("b"), prompt) == 0


def test_a_hybrid_hit_ends_at_the_last_block_a_state_checkpoint_follows():
    prompt = PromptBlocks(PROMPT)
    blocks = prompt.digests(BS)
    hybrid = state("h", cached_prompt=SYSTEM)
    hybrid.checkpoints = frozenset([blocks[3], blocks[5]])  # after 4 and 6 blocks
    assert expected_hit(hybrid, prompt) == 6 * BS
    hybrid.checkpoints = frozenset([blocks[8]])  # past the cached run: no use
    assert expected_hit(hybrid, prompt) == 0
    hybrid.checkpoints = None  # a model without state layers
    assert expected_hit(hybrid, prompt) == len(SYSTEM)


def test_cache_aware_prefers_the_cached_prefix_until_its_load_outweighs_it():
    prompt = PromptBlocks(PROMPT)
    policy = CacheAware()
    cold, warm = state("cold"), state("warm", cached_prompt=SYSTEM)
    assert policy.choose([cold, warm], prompt, 8).name == "warm"
    # Work queued on the warm engine beyond the tokens its hit saves sends the request elsewhere.
    busy = state("warm", cached_prompt=SYSTEM, waiting_tokens=len(SYSTEM) + 1)
    assert policy.choose([cold, busy], prompt, 8).name == "cold"
    # Equal cost: the longer hit wins the tie.
    even = state("warm", cached_prompt=SYSTEM, waiting_tokens=len(SYSTEM))
    assert policy.choose([cold, even], prompt, 8).name == "warm"
    # A warm engine without room for the uncached prompt and the output is the last resort.
    full = state("warm", cached_prompt=SYSTEM, free=2)
    assert policy.choose([cold, full], prompt, 8).name == "cold"
    assert policy.choose([full], prompt, 8).name == "warm"


def test_least_loaded_counts_queued_tokens_and_requests_then_free_blocks():
    prompt = PromptBlocks(PROMPT)
    policy = LeastLoaded()
    a = state("a", waiting_tokens=RUNNING_WEIGHT * 2 + 1)
    b = state("b", running=2)
    assert policy.choose([a, b], prompt, 8).name == "b"
    # A cached prefix is no reason for least_loaded.
    assert policy.choose([state("a", cached_prompt=SYSTEM, running=1), state("b")], prompt, 8).name == "b"
    assert policy.choose([state("a", free=100), state("b", free=200)], prompt, 8).name == "b"


def test_ties_go_round_in_turn_and_dispatches_count_until_the_next_summary():
    prompt = PromptBlocks(PROMPT)
    for policy in (RoundRobin(), LeastLoaded(), CacheAware()):
        states = [state(n) for n in "abc"]
        assert [policy.choose(states, prompt, 8).name for _ in range(6)] == list("abcabc")
    # Each role takes its own turns: a PD request's two choices do not pair engines for ever.
    policy = RoundRobin()
    prefill, decode = [state(n, role="prefill") for n in "pq"], [state(n) for n in "de"]
    pairs = [(policy.choose(decode, prompt, 8).name, policy.choose(prefill, prompt, 8).name) for _ in range(4)]
    assert pairs == [("d", "p"), ("e", "q"), ("d", "p"), ("e", "q")]
    # Between summaries the router's own dispatches make an engine look busier.
    a, b = state("a", cached_prompt=SYSTEM), state("b")
    policy = CacheAware()
    assert policy.choose([a, b], prompt, 8).name == "a"
    a.sent.append((1.0, len(SYSTEM) + 1))
    assert policy.choose([a, b], prompt, 8).name == "b"
    # A summary taken after the dispatch counts it itself: the router's entry is dropped.
    a.record(EngineSummary(0, 0, 0, 1000, 1000, BS, 64, 2, None), polled_at=2.0)
    assert not a.sent and a.cached  # `cached` None: the digest held is kept
    assert policy.choose([a, b], prompt, 8).name == "a"


def test_a_stale_summary_costs_a_miss_only():
    """The digest says an engine holds a prefix it has since evicted: the policy still picks
    it (that is the guess), and the engines' outputs do not depend on it (the real-engine test)."""
    prompt = PromptBlocks(PROMPT)
    stale = state("stale", cached_prompt=SYSTEM)
    assert CacheAware().choose([state("cold"), stale], prompt, 8).name == "stale"
    with pytest.raises(ValueError, match="no engine"):
        CacheAware().choose([], prompt, 8)
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_policy("random")  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold", [0, len(PROMPT) - len(SYSTEM), len(PROMPT) - len(SYSTEM) + 1])
def test_conditional_disaggregation_on_both_sides_of_the_threshold(threshold):
    decode = state("d", cached_prompt=SYSTEM)
    prefill = [state("p", role="prefill")]
    hit = expected_hit(decode, PromptBlocks(PROMPT))
    d = decide(threshold, decode, hit, prefill, len(PROMPT), 8)
    assert d.uncached_tokens == len(PROMPT) - len(SYSTEM)
    if threshold == 0:
        assert (d.decision, d.reason) == ("remote", "always_remote")
    elif d.uncached_tokens < threshold:
        assert (d.decision, d.reason) == ("local", "short_prompt")
    else:
        assert (d.decision, d.reason) == ("remote", "long_prompt")


def test_a_long_prompt_stays_local_only_while_every_prefill_engine_is_saturated():
    decode = state("d")
    queued = SATURATED_STEPS * 64
    busy, idle = state("p0", role="prefill", waiting_tokens=queued), state("p1", role="prefill")
    assert decide(4, decode, 0, [busy, idle], len(PROMPT), 8).decision == "remote"
    d = decide(4, decode, 0, [busy, state("p1", role="prefill", waiting_tokens=queued)], len(PROMPT), 8)
    assert (d.decision, d.reason) == ("local", "prefill_saturated")
    # No prefill engine to take it (all draining, say): computed where it decodes, whatever the threshold.
    alone = decide(0, decode, 0, [], len(PROMPT), 8)
    assert (alone.decision, alone.reason) == ("local", "no_prefill_engine")
    # ... and the decode engine has room: not with requests waiting there.
    crowded = state("d", waiting=1, waiting_tokens=10)
    assert decide(4, crowded, 0, [busy], len(PROMPT), 8).decision == "remote"


def test_an_engine_that_dies_between_the_decision_and_the_call_is_left_out_and_the_request_resumed(checkpoint):
    """Two in-process engines; e1 holds the prompt's prefix, so cache_aware picks it, but its
    worker is closed before the call: the request resumes on e0 with the undisturbed tokens, and
    the next decision leaves e1 out."""
    cfg = config(checkpoint)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]

    async def main() -> tuple[list[int], list[int], int, list[str]]:
        (core0, worker0), (core1, worker1) = build_local_engine(cfg), build_local_engine(cfg)
        router = ColocatedRouter([Engine.local("e0", core0), Engine.local("e1", core1)], policy=CacheAware())
        try:

            async def tokens(req_id: str) -> list[int]:
                outs: list[RequestOutput] = [o async for o in router.generate(prompt, sampling, req_id)]
                assert outs[-1].finish_reason == "length", outs[-1]
                return [t for o in outs for t in o.new_token_ids]

            await router.refresh()
            first = await tokens("first")  # both idle and cold: e0, in turn
            await router.refresh()
            # A hybrid (NemotronH): a hit up to the prompt's last full block, after which the
            # engine keeps a state checkpoint (docs/design.md §21), as its summary says.
            assert router.fleet.state("e0").checkpoints
            assert expected_hit(router.fleet.state("e0"), PromptBlocks(prompt)) == 12
            # Make e1 the warm one: the same prompt straight on it.
            async for _ in router.fleet.engine("e1").client.generate(prompt, sampling, "warm-e1"):
                pass
            await router.refresh()
            router.fleet.state("e0").sent.append((float("inf"), 10_000))  # e0 looks busy
            worker1.close()  # e1 dies after the last summary, before the call
            again = await tokens("after-death")
            chosen_after = [router.policy.choose(router.fleet.candidates("colocated"), PromptBlocks(prompt), 12).name]
            return first, again, router.num_resumed, chosen_after
        finally:
            await router.close()
            await core0.close()
            await core1.close()
            worker0.close()

    first, again, resumed, chosen_after = asyncio.run(main())
    assert again == first
    assert resumed == 1
    assert chosen_after == ["e0"]


def test_an_engine_sends_its_digest_only_when_its_cache_changed(checkpoint):
    cfg = config(checkpoint)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]

    async def main() -> None:
        core, worker = build_local_engine(cfg)
        try:
            empty = core.routing_summary(None)
            assert empty.cached == frozenset() and empty.block_size == 4
            assert core.routing_summary(empty.cache_version).cached is None
            sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            engine = Engine.local("e", core)
            async for _ in engine.client.generate(prompt, sampling, "r"):
                pass
            await core.wait_idle()
            await engine.client.close()
            after = core.routing_summary(empty.cache_version)
            assert after.cache_version != empty.cache_version
            assert after.cached and after.checkpoints  # a hybrid: blocks, and checkpoints after some
            assert core.routing_summary(after.cache_version).cached is None
            assert (after.num_running, after.num_waiting, after.waiting_tokens) == (0, 0, 0)
        finally:
            await core.close()
            worker.close()

    asyncio.run(main())


def test_summaries_are_polled_only_while_a_decision_reads_them():
    """A lone colocated engine takes every request: polling it would only cost CPU. A second
    engine (an autoscaler's), or a PD pair, makes the poll start."""
    polled: list[str] = []

    def engine(name: str) -> Engine:
        async def summary(since_version: int | None) -> EngineSummary:
            polled.append(name)
            return EngineSummary(0, 0, 0, 1000, 1000, BS, 64, 1, None)

        async def stats():
            raise AssertionError("not read by the poll")

        return Engine(name, client=None, stats=stats, summary=summary)  # type: ignore[arg-type]

    async def polls_for(fleet: Fleet) -> list[str]:
        polled.clear()
        task = asyncio.get_running_loop().create_task(fleet.run(0.001))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return polled

    async def main() -> None:
        fleet = Fleet([(engine("e0"), "colocated")])
        assert not fleet.chooses() and await polls_for(fleet) == []
        fleet.add(engine("e1"), "colocated")
        assert fleet.chooses() and {"e0", "e1"} <= set(await polls_for(fleet))
        pd = Fleet([(engine("d"), "decode"), (engine("p"), "prefill")])
        assert pd.chooses() and {"d", "p"} <= set(await polls_for(pd))

    asyncio.run(main())
