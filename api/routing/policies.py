"""Routing policies: which engine of one role takes a request (docs/design.md §22).

Every policy picks among the candidates the fleet gives it at the decision (api/routing/fleet.py),
from their latest summaries plus what was sent since. Costs are in prompt tokens of work ahead
of the request on that engine:

    load(e) = queued_tokens(e) + RUNNING_WEIGHT * requests(e)              (least_loaded)
    cost(e) = (prompt_tokens - hit_tokens(e)) + load(e)                    (cache_aware)

`hit_tokens(e)` is the longest run of the prompt's leading full blocks in e's digest
(api/routing/prefix.py). An engine whose free KV cannot hold the uncached prompt plus the
request's output is taken only when every candidate is that full (it would preempt or queue).
Ties go to the longer hit, then the more free KV, then in turn (so an idle fleet with nothing
cached spreads requests like round robin).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import get_args

from api.routing.fleet import EngineState
from api.routing.prefix import PromptBlocks
from engine.config import RouterPolicy

POLICIES: tuple[RouterPolicy, ...] = get_args(RouterPolicy)

# A request running (or waiting) on an engine counts as this many prompt tokens of work: each
# takes a token of every step's budget and a share of its time, whatever its prompt was.
RUNNING_WEIGHT = 16


def expected_hit(state: EngineState, prompt: PromptBlocks) -> int:
    """Prompt tokens `state`'s engine should find cached, by its last digest."""
    if state.block_size is None or not state.cached:
        return 0
    return prompt.hit_tokens(state.cached, state.block_size, state.checkpoints)


def load(state: EngineState) -> int:
    return state.queued_tokens + RUNNING_WEIGHT * state.num_requests


def fits(state: EngineState, uncached_tokens: int, max_tokens: int) -> bool:
    """Whether the engine's free KV holds the uncached prompt and the output; an engine not yet
    heard from is taken to have room."""
    free = state.free_tokens
    return free is None or free >= uncached_tokens + max_tokens


class Policy(ABC):
    name: RouterPolicy

    def __init__(self) -> None:
        # One turn per role: a PD request takes a turn from each, and a shared counter would
        # pair decode engine i with prefill engine i + 1 for ever.
        self._turns: dict[str, itertools.count[int]] = {}

    def choose(self, candidates: Sequence[EngineState], prompt: PromptBlocks, max_tokens: int) -> EngineState:
        if not candidates:
            raise ValueError("no engine to choose from")
        return self._choose(candidates, prompt, max_tokens)

    @abstractmethod
    def _choose(self, candidates: Sequence[EngineState], prompt: PromptBlocks, max_tokens: int) -> EngineState: ...

    def _in_turn(self, tied: Sequence[EngineState]) -> EngineState:
        turn = self._turns.setdefault(tied[0].role, itertools.count())
        return tied[next(turn) % len(tied)]


class RoundRobin(Policy):
    """Each engine in turn, whatever it holds: the baseline."""

    name = "round_robin"

    def _choose(self, candidates: Sequence[EngineState], prompt: PromptBlocks, max_tokens: int) -> EngineState:
        return self._in_turn(candidates)


class _Scored(Policy):
    """The candidates with the lowest (room, cost, -hit, -free) key; ties in turn."""

    def _choose(self, candidates: Sequence[EngineState], prompt: PromptBlocks, max_tokens: int) -> EngineState:
        keys = {}
        for s in candidates:
            hit = self.hit(s, prompt)
            uncached = len(prompt) - hit
            room = fits(s, uncached, max_tokens)
            free = s.free_tokens if s.free_tokens is not None else 0
            keys[s.name] = (not room, self.cost(s, uncached), -hit, -free)
        best = min(keys.values())
        return self._in_turn([s for s in candidates if keys[s.name] == best])

    @abstractmethod
    def hit(self, state: EngineState, prompt: PromptBlocks) -> int: ...

    @abstractmethod
    def cost(self, state: EngineState, uncached_tokens: int) -> int: ...


class LeastLoaded(_Scored):
    """The engine with the least work ahead: queued prompt tokens and requests held."""

    name = "least_loaded"

    def hit(self, state: EngineState, prompt: PromptBlocks) -> int:
        return 0

    def cost(self, state: EngineState, uncached_tokens: int) -> int:
        return load(state)


class CacheAware(_Scored):
    """The engine where the request's own uncached prompt plus the work ahead of it is least."""

    name = "cache_aware"

    def hit(self, state: EngineState, prompt: PromptBlocks) -> int:
        return expected_hit(state, prompt)

    def cost(self, state: EngineState, uncached_tokens: int) -> int:
        return uncached_tokens + load(state)


def make_policy(name: RouterPolicy) -> Policy:
    kinds: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)}
    if name not in kinds:
        raise ValueError(f"unknown router {name!r}: one of {', '.join(POLICIES)}")
    return kinds[name]()
