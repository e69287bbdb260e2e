"""The fleet simulation's workload: chat sessions over shared system prompts.

Each session picks one of `num_systems` system prompts (Zipf popularity, as a few assistants
or tools take most traffic), then runs several turns: each turn's prompt is the system prompt,
the whole history (earlier user messages and answers) and a new user message, sent after the
previous answer and a think time. So a fleet sees prefixes shared across sessions (the system
prompts) and within one (the history), as in a multi-turn chat service.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TraceShape:
    num_systems: int = 48
    system_tokens: tuple[int, int] = (1024, 3072)
    zipf_s: float = 1.1
    turns: tuple[int, int] = (1, 6)
    user_tokens: tuple[int, int] = (50, 400)
    output_tokens: tuple[int, int] = (32, 256)
    think_s: float = 2.0  # mean think time between an answer and the next turn
    vocab: int = 50_000


@dataclass(slots=True)
class Session:
    """One chat; its own random stream, so its turns are the same whatever the timing."""

    system: list[int]
    turns_left: int
    rng: random.Random
    history: list[int] = field(default_factory=list)


class Trace:
    """Sessions arriving as a Poisson process at `session_rate` per second, deterministic in `seed`."""

    def __init__(self, shape: TraceShape, session_rate: float, seed: int) -> None:
        self.shape = shape
        self.session_rate = session_rate
        self.seed = seed
        self.rng = random.Random(seed)  # arrivals and system prompts; each session has its own
        self.systems = [self._tokens(self.rng, *shape.system_tokens) for _ in range(shape.num_systems)]
        self._sessions = 0
        weights = [1 / (k + 1) ** shape.zipf_s for k in range(shape.num_systems)]
        total = sum(weights)
        self.weights = [w / total for w in weights]

    def _tokens(self, rng: random.Random, lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, self.shape.vocab) for _ in range(rng.randint(lo, hi))]

    def next_arrival_gap(self) -> float:
        return self.rng.expovariate(self.session_rate)

    def new_session(self) -> Session:
        self._sessions += 1
        rng = random.Random(f"{self.seed}-{self._sessions}")
        system = rng.choices(self.systems, self.weights)[0]
        return Session(system, rng.randint(*self.shape.turns), rng)

    def next_turn(self, session: Session) -> tuple[list[int], int]:
        """The turn's prompt and output length; the session's history grows by the message."""
        session.history += self._tokens(session.rng, *self.shape.user_tokens)
        session.turns_left -= 1
        return session.system + session.history, session.rng.randint(*self.shape.output_tokens)

    def answer(self, session: Session, num_tokens: int) -> None:
        """The answer joins the history (its ids stand for whatever the model said)."""
        session.history += [session.rng.randrange(1, self.shape.vocab) for _ in range(num_tokens)]

    def think_time(self, session: Session) -> float:
        return session.rng.expovariate(1 / self.shape.think_s)
