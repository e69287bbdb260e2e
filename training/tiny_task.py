"""Associative recall: the task the shipped tiny model is trained and evaluated on.

A prompt lists key/value pairs and then asks for the value of one key::

    ab=381;qe=027;zt=950;?qe=        ->  answer "027", then EOS

Why this task: the value of the queried key sits many KV blocks back in the
prompt and only an attention layer can fetch it (a small Mamba state cannot hold
dozens of random pairs), so a decode engine that sees zeroed or stale KV answers
wrong while one that sees the transferred KV answers right. The answer is three
tokens, so every decode step after the first one also reads the prompt's KV.

Keys are unique within a prompt (a repeated key would make the answer ambiguous)
and drawn from letters; values are digits, so a key and a value never look alike.
The query repeats the pair's own ``key=`` shape, so "find the same key=" and
"copy what follows" is all the model has to learn. Every character is one byte,
hence one token of the byte-level tokenizer, so lengths in characters are lengths
in tokens.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from kv.cache_group import cdiv

KEY_CHARS = string.ascii_lowercase
VALUE_CHARS = string.digits
KEY_LEN = 2
VALUE_LEN = 3
BIND = "="
PAIR_END = ";"
QUERY = "?"

PAIR_TOKENS = KEY_LEN + len(BIND) + VALUE_LEN + len(PAIR_END)
QUERY_TOKENS = len(QUERY) + KEY_LEN + len(BIND)
MIN_PROMPT_TOKENS = 64
MAX_PROMPT_TOKENS = 256
# Pair counts whose one-query prompt length falls inside the bounds above.
MIN_PAIRS = cdiv(MIN_PROMPT_TOKENS - QUERY_TOKENS, PAIR_TOKENS)
MAX_PAIRS = (MAX_PROMPT_TOKENS - QUERY_TOKENS) // PAIR_TOKENS

EVAL_SEED = 0


@dataclass(frozen=True, slots=True)
class Sample:
    """One context of key/value pairs and the keys asked about it, in order."""

    pairs: tuple[tuple[str, str], ...]
    queries: tuple[str, ...]

    @property
    def context(self) -> str:
        """The pairs as the prompt spells them, each closed by ``PAIR_END``."""
        return "".join(f"{key}{BIND}{value}{PAIR_END}" for key, value in self.pairs)

    def answer(self, key: str) -> str:
        """The value stored under ``key``."""
        return dict(self.pairs)[key]


def query_text(key: str) -> str:
    """The text that asks for ``key``; the answer follows it directly."""
    return f"{QUERY}{key}{BIND}"


def make_sample(rng: random.Random, num_queries: int = 1, max_pairs: int = MAX_PAIRS) -> Sample:
    """Draw a context of unique keys and ``num_queries`` distinct keys to ask for.

    The pair count is uniform over ``MIN_PAIRS..max_pairs``; the default range keeps a
    one-query prompt within ``MIN_PROMPT_TOKENS..MAX_PROMPT_TOKENS``, so prompts span 5
    to 16 KV blocks of 16. Training lowers ``max_pairs`` early on as a curriculum.
    """
    if not MIN_PAIRS <= max_pairs <= MAX_PAIRS:
        raise ValueError(f"max_pairs must be in {MIN_PAIRS}..{MAX_PAIRS}, got {max_pairs}")
    num_pairs = rng.randint(MIN_PAIRS, max_pairs)
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(f"num_queries must be in 1..{num_pairs}, got {num_queries}")
    keys = _unique_strings(rng, KEY_CHARS, KEY_LEN, num_pairs)
    pairs = tuple((key, "".join(rng.choices(VALUE_CHARS, k=VALUE_LEN))) for key in keys)
    return Sample(pairs=pairs, queries=tuple(rng.sample(keys, num_queries)))


def _unique_strings(rng: random.Random, chars: str, length: int, count: int) -> list[str]:
    """``count`` distinct random strings; rejection is cheap because 26**2 >> MAX_PAIRS."""
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen.setdefault("".join(rng.choices(chars, k=length)))
    return list(seen)


def task_rng(stream: str, seed: int) -> random.Random:
    """A generator per purpose ("train", "valid", "eval"): streams never share draws, so
    training data cannot replay eval prompts whatever seed either one uses."""
    return random.Random(f"{stream}:{seed}")


def eval_records(n: int, seed: int = EVAL_SEED, stream: str = "eval") -> list[dict[str, str]]:
    """``n`` one-query records ``{"prompt", "answer"}``, the format of ``eval.jsonl``."""
    rng = task_rng(stream, seed)
    records = []
    for _ in range(n):
        sample = make_sample(rng)
        key = sample.queries[0]
        records.append({"prompt": sample.context + query_text(key), "answer": sample.answer(key)})
    return records
