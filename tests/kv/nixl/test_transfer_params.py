"""`KVTransferParams`: typed from the prefill scheduler to the decode engine, crossing processes
unchanged, and validated once where it enters the decode engine (a bad field is named)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from kv.nixl.transfer_params import KVTransferParams


def test_transfer_params_cross_processes_unchanged():
    p = KVTransferParams("engine", "agent", ((1, 2), (), (7,)), 9, "req", 12.5)
    assert pickle.loads(pickle.dumps(p)) == p
    p.validate()


@pytest.mark.parametrize(
    "change",
    [
        {"num_tokens": "9"},
        {"num_tokens": True},
        {"num_tokens": -1},
        {"remote_block_ids": ((1, "2"),)},
        {"remote_block_ids": ((1, -2),)},
        {"remote_block_ids": (1, 2)},
        {"remote_block_ids": [[1, 2]]},
        {"remote_block_ids": "12"},
        {"request_id": 5},
        {"remote_agent_name": ""},
        {"expires_at": float("nan")},
        {"expires_at": "soon"},
    ],
)
def test_transfer_params_validate_names_a_bad_field(change):
    p = dataclasses.replace(KVTransferParams("engine", "agent", ((1, 2),), 9, "req"), **change)
    with pytest.raises(ValueError, match=next(iter(change))):
        p.validate()


def test_transfer_params_carry_checksums_per_rank_pair_shaped_like_their_blocks():
    # Two prefill ranks x one decode rank, two groups.
    p = KVTransferParams("e", "a", ((1, 2), (7,)), 8, "r", 5.0, ((((10, -20), (30,)),), (((11, 21), (31,)),)))
    p.validate()
    assert p.sliced([slice(1, 2), slice(0, 1)]).page_checksums == ((((-20,), (30,)),), (((21,), (31,)),))
    one = [[[10, 20], [30]]]
    for bad in (
        [[[[10], [30]]]],  # a group one block short
        [[[[10, "x"], [30]]]],
        [[[[10, 20]]]],  # a group missing
        [[[[10, 20], [30]]], [[[10, 20], [30]], [[10, 20], [30]]]],  # prefill ranks with unequal decode ranks
        [],
        [[]],
        one,  # three levels, not four
        5,
    ):
        with pytest.raises(ValueError, match="page_checksums"):
            dataclasses.replace(p, page_checksums=_tuples(bad)).validate()


def _tuples(value: object) -> object:
    """Nested lists as the nested tuples a `KVTransferParams` holds."""
    return tuple(map(_tuples, value)) if isinstance(value, list) else value
