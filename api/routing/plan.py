"""One PD request's route: its decode engine, whether its prompt is computed there, and if
not, its prefill engine. The router (api/router.py) and the fleet simulation
(bench/fleet_sim.py) both route by this, so what the simulation measures is the code that serves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.routing.disagg import DisaggDecision, decide
from api.routing.fleet import EngineState
from api.routing.policies import Policy, expected_hit
from api.routing.prefix import PromptBlocks


@dataclass(frozen=True, slots=True)
class Route:
    decode: EngineState
    prefill: EngineState | None  # None: the prompt is computed on the decode engine
    disagg: DisaggDecision
    prefill_hit: int  # tokens the prefill engine should find cached (0 when local)


def route(
    policy: Policy,
    decode: Sequence[EngineState],
    prefill: Sequence[EngineState],
    prompt: PromptBlocks,
    max_tokens: int,
    min_prefill_tokens: int,
) -> Route:
    """The decode engine first (its own hit decides whether a transfer pays), then the prefill
    engine for a remote prompt."""
    chosen = policy.choose(decode, prompt, max_tokens)
    d = decide(min_prefill_tokens, chosen, expected_hit(chosen, prompt), prefill, len(prompt), max_tokens)
    if d.decision == "local":
        return Route(chosen, None, d, 0)
    p = policy.choose(prefill, prompt, max_tokens)
    return Route(chosen, p, d, expected_hit(p, prompt))
