from __future__ import annotations

import random
import re

import pytest

from training import tiny_task
from training.tiny_task import Sample, eval_records, make_sample, query_text


def _lookup(prompt: str) -> str:
    """Answer a prompt by reading it, the way the model has to: find ``key=`` and copy the value."""
    context, _, key = prompt[:-1].rpartition(tiny_task.QUERY)
    matches = re.findall(rf"(?:^|;){re.escape(key)}=(\d+);", context)
    assert len(matches) == 1, f"key {key!r} must occur exactly once"
    return matches[0]


def test_eval_records_are_deterministic_per_seed() -> None:
    assert eval_records(20, seed=5) == eval_records(20, seed=5)
    assert eval_records(20, seed=5) != eval_records(20, seed=6)


def test_streams_are_independent_for_the_same_seed() -> None:
    assert eval_records(20, seed=0, stream="train") != eval_records(20, seed=0, stream="eval")


@pytest.mark.parametrize("seed", range(3))
def test_prompt_lengths_cover_the_bounds(seed: int) -> None:
    lengths = [len(r["prompt"]) for r in eval_records(500, seed=seed)]
    assert min(lengths) >= tiny_task.MIN_PROMPT_TOKENS
    assert max(lengths) <= tiny_task.MAX_PROMPT_TOKENS
    # Both ends of the pair-count range are drawn, so short and long prompts are tested.
    assert min(lengths) < 80 and max(lengths) > 240


def test_keys_are_unique_and_queries_are_distinct_known_keys() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sample = make_sample(rng, num_queries=4)
        keys = [key for key, _ in sample.pairs]
        assert len(set(keys)) == len(keys)
        assert len(set(sample.queries)) == 4 and set(sample.queries) <= set(keys)


def test_answer_is_recoverable_from_the_prompt() -> None:
    for record in eval_records(200):
        assert len(record["answer"]) == tiny_task.VALUE_LEN
        assert _lookup(record["prompt"]) == record["answer"]


def test_prompt_text_is_one_byte_per_character() -> None:
    for record in eval_records(50):
        text = record["prompt"] + record["answer"]
        assert len(text.encode()) == len(text)


def test_sample_answer_and_query_text() -> None:
    sample = Sample(pairs=(("ab", "123"), ("cd", "456")), queries=("cd",))
    assert sample.context == "ab=123;cd=456;"
    assert sample.answer("cd") == "456"
    assert query_text("cd") == "?cd="


def test_too_many_queries_is_rejected() -> None:
    with pytest.raises(ValueError):
        make_sample(random.Random(0), num_queries=tiny_task.MAX_PAIRS + 1)


def test_max_pairs_caps_the_context() -> None:
    rng = random.Random(0)
    counts = {len(make_sample(rng, max_pairs=tiny_task.MIN_PAIRS + 2).pairs) for _ in range(100)}
    assert counts == set(range(tiny_task.MIN_PAIRS, tiny_task.MIN_PAIRS + 3))
    with pytest.raises(ValueError):
        make_sample(rng, max_pairs=tiny_task.MAX_PAIRS + 1)
