"""Conditional disaggregation: whether a PD request's prompt is computed on a prefill engine and
its KV moved, or on the chosen decode engine itself (docs/design.md §22).

A transfer pays off only for a prompt long enough that computing it elsewhere spares the
decode engine's running requests more than the hand-over costs the request; a short one, or one
whose prompt the decode engine mostly holds already, is cheaper computed where it will decode.
Outputs are the same either way: the decode engine computes exactly the prompt a prefill
engine would have (the tests check it token for token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from api.routing.fleet import EngineState
from api.routing.policies import fits

Decision = Literal["local", "remote"]
# Why: the uncached prompt is below (or not below) the threshold, every prefill engine is
# saturated while the decode engine has room, conditional disaggregation is off, or no prefill
# engine takes requests (all draining or gone while others start): the decode engine computes it.
Reason = Literal["short_prompt", "prefill_saturated", "long_prompt", "always_remote", "no_prefill_engine"]
DECISIONS: tuple[Decision, ...] = ("local", "remote")
REASONS: tuple[Reason, ...] = get_args(Reason)

# A prefill engine with more than this many steps' worth of prompt tokens queued is saturated.
SATURATED_STEPS = 4


@dataclass(frozen=True, slots=True)
class DisaggDecision:
    decision: Decision
    reason: Reason
    uncached_tokens: int  # the prompt minus the decode engine's expected hit


def saturated(state: EngineState, uncached_tokens: int, max_tokens: int) -> bool:
    s = state.summary
    if s is None:
        return False
    return state.queued_tokens >= SATURATED_STEPS * s.max_num_batched_tokens or not fits(
        state, uncached_tokens, max_tokens
    )


def has_room(state: EngineState, uncached_tokens: int, max_tokens: int) -> bool:
    """Whether the decode engine can compute the prompt now: nothing queued there, the prompt
    fits one step's budget, and its KV holds prompt and output."""
    s = state.summary
    if s is None:
        return False
    return (
        state.queued_tokens == 0
        and s.num_waiting == 0
        and uncached_tokens <= s.max_num_batched_tokens
        and fits(state, uncached_tokens, max_tokens)
    )


def decide(
    min_prefill_tokens: int,
    decode: EngineState,
    decode_hit: int,
    prefill: Sequence[EngineState],
    prompt_tokens: int,
    max_tokens: int,
) -> DisaggDecision:
    """`min_prefill_tokens` 0 turns conditional disaggregation off: every prompt goes remote."""
    uncached = prompt_tokens - decode_hit
    if not prefill:
        return DisaggDecision("local", "no_prefill_engine", uncached)
    if min_prefill_tokens <= 0:
        return DisaggDecision("remote", "always_remote", uncached)
    if uncached < min_prefill_tokens:
        return DisaggDecision("local", "short_prompt", uncached)
    all_saturated = all(saturated(p, prompt_tokens, max_tokens) for p in prefill)
    if all_saturated and has_room(decode, uncached, max_tokens):
        return DisaggDecision("local", "prefill_saturated", uncached)
    return DisaggDecision("remote", "long_prompt", uncached)
