"""Prompts for `bench.load` beyond the model's eval set, as token ids (any model serves them):

- `shared_prefix`: a few long system prompts, each followed by many short user messages, sent
  interleaved, so where a prompt is routed decides whether its prefix is found cached;
- `short_long`: short prompts mixed with long ones, for conditional disaggregation (a short
  prompt computed on its decode engine skips the prefill engine's queue and the transfer).
"""

from __future__ import annotations

import random


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab - 2) for _ in range(n)]  # clear of the special ids at the ends


def shared_prefix(
    n: int, vocab: int, seed: int = 0, num_systems: int = 4, system_tokens: int = 768, user_tokens: int = 48
) -> list[list[int]]:
    """`n` prompts, the i-th on system prompt i % num_systems, each user message distinct."""
    rng = random.Random(seed)
    systems = [_ids(rng, system_tokens, vocab) for _ in range(num_systems)]
    return [systems[i % num_systems] + _ids(rng, rng.randint(user_tokens // 2, user_tokens), vocab) for i in range(n)]


def short_long(
    n: int, vocab: int, seed: int = 0, short_tokens: int = 24, long_tokens: int = 768, long_every: int = 3
) -> list[list[int]]:
    """`n` prompts, every `long_every`-th one long, the others short; none shares a prefix."""
    rng = random.Random(seed)
    return [
        _ids(rng, long_tokens if i % long_every == 0 else rng.randint(short_tokens // 2, short_tokens), vocab)
        for i in range(n)
    ]
