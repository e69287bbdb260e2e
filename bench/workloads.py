"""Prompts for `bench.load` beyond the model's eval set, as token ids (any model serves them):

- `shared_prefix`: a few long system prompts, each followed by many short user messages, sent
  interleaved, so where a prompt is routed decides whether its prefix is found cached;
- `short_long`: short prompts mixed with long ones, for conditional disaggregation (a short
  prompt computed on its decode engine skips the prefill engine's queue and the transfer);
- `systems_and_chats`: system prompts under many questions, then multi-turn chats, each turn the
  one before plus a reply and a new message, for prefix caching (hybrids included: a hit needs
  a state checkpoint at its boundary, docs/design.md §21).
"""

from __future__ import annotations

import random


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab - 2) for _ in range(n)]  # clear of the special ids at the ends


def shared_prefix(
    n: int, vocab: int, seed: int = 0, num_systems: int = 5, system_tokens: int = 512, user_tokens: int = 48
) -> list[list[int]]:
    """`n` prompts, the i-th on system prompt i % num_systems, each user message distinct. With
    more system prompts than an engine's cache holds, sent in turn, an engine that sees them all
    finds each evicted just before it comes back (LRU); an odd count keeps the turn from lining
    up with two engines taken in turn, which would route by cache by accident."""
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


def systems_and_chats(
    n: int,
    vocab: int,
    seed: int = 0,
    num_systems: int = 8,
    system_tokens: int = 200,
    user_tokens: int = 24,
    chats: int = 16,
    turns: int = 4,
    turn_tokens: int = 40,
) -> list[list[int]]:
    """`n` prompts: the last `chats * turns` are chats, turn after turn (every chat's first turn,
    then every second one, ...), each turn its previous turn plus `turn_tokens` more (a reply
    and a message); the others sit on system prompt i % num_systems with a distinct question."""
    rng = random.Random(seed)
    num_chat_prompts = min(n, chats * turns)
    shared = shared_prefix(n - num_chat_prompts, vocab, seed, num_systems, system_tokens, user_tokens)
    talks = [_ids(rng, rng.randint(turn_tokens, 2 * turn_tokens), vocab) for _ in range(chats)]
    turned: list[list[int]] = []
    while len(turned) < num_chat_prompts:
        turned.extend(list(t) for t in talks)
        talks = [t + _ids(rng, turn_tokens, vocab) for t in talks]
    return shared + turned[:num_chat_prompts]
