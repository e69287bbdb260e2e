"""`bench.load`'s routing workloads and `--compare`: the prompts share what they claim to, and a
bad field or value is a usage error naming it, before any deployment starts."""

from __future__ import annotations

import itertools

import pytest

from bench.load import main
from bench.workloads import shared_prefix, short_long, systems_and_chats


def test_shared_prefix_prompts_share_their_system_prompt_and_differ_after_it():
    prompts = shared_prefix(9, vocab=96, num_systems=3, system_tokens=64, user_tokens=16)
    assert prompts[0][:64] == prompts[3][:64] == prompts[6][:64] != prompts[1][:64]
    assert len({tuple(p[:64]) for p in prompts}) == 3
    assert len({tuple(p[64:]) for p in prompts}) == len(prompts)
    assert all(2 <= t < 94 for p in prompts for t in p)


def test_short_long_mixes_the_two_lengths():
    lengths = [len(p) for p in short_long(9, vocab=96, short_tokens=24, long_tokens=300, long_every=3)]
    assert lengths[::3] == [300] * 3
    assert all(12 <= n <= 24 for i, n in enumerate(lengths) if i % 3)


@pytest.mark.parametrize(
    ("arg", "message"),
    [("routr=cache_aware", "not FIELD=VALUE"), ("router=", "not FIELD=VALUE"), ("router=random", "invalid router")],
)
def test_a_bad_compare_is_refused_by_name(capsys, arg, message):
    try:
        code = main(["--compare", arg, "--layouts", "1x1", "--workload", "short-long", "--requests", "1"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_systems_and_chats_grow_each_chat_turn_by_turn():
    prompts = systems_and_chats(20, vocab=96, num_systems=2, system_tokens=32, chats=3, turns=4, turn_tokens=8)
    shared, chats = prompts[:8], prompts[8:]
    assert all(p[:32] == shared[i % 2][:32] for i, p in enumerate(shared))
    for c in range(3):
        turns = chats[c::3]
        assert len(turns) == 4
        assert all(b[: len(a)] == a and len(b) == len(a) + 8 for a, b in itertools.pairwise(turns))
