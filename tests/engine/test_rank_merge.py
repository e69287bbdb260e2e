"""Merging tensor-parallel ranks' step results: rank 0's tokens, loads that end only when
every rank's part ended, every rank's read notifications passed on."""

from __future__ import annotations

import pytest

from engine.messages import ModelRunnerOutput
from engine.rank_merge import RankDisagreementError, RankMerger


def out(step: int, **kw) -> ModelRunnerOutput:
    return ModelRunnerOutput(step, kw.pop("sampled", {"a": 5}), **kw)


def test_one_rank_passes_through():
    r = out(0, finished_recving=["x"])
    assert RankMerger(1).merge([r]) is r


def test_disagreeing_tokens_fail_loudly():
    with pytest.raises(RankDisagreementError, match="rank 1 sampled"):
        RankMerger(2).merge([out(0), out(0, sampled={"a": 6})])


def test_a_load_ends_when_every_rank_part_ended():
    m = RankMerger(2)
    first = m.merge([out(0, finished_recving=["x"]), out(0)])
    assert first.finished_recving == [] and first.failed_loads == {}
    second = m.merge([out(1), out(1, finished_recving=["x"])])
    assert second.finished_recving == ["x"]


def test_a_load_fails_if_any_part_failed_with_the_union_of_bad_blocks():
    m = RankMerger(3)
    a = m.merge([out(0, failed_loads={"x": [4, 2]}), out(0, finished_recving=["x"]), out(0)])
    assert a.failed_loads == {} and a.finished_recving == []
    b = m.merge([out(1), out(1), out(1, failed_loads={"x": [2, 9]})])
    assert b.failed_loads == {"x": [2, 4, 9]} and b.finished_recving == []


def test_every_ranks_read_notifications_are_passed_on_for_the_held_record_to_count():
    m = RankMerger(2)
    assert m.merge([out(0, finished_sending=["p", "q"]), out(0)]).finished_sending == ["p", "q"]
    assert m.merge([out(1), out(1, finished_sending=["p"])]).finished_sending == ["p"]
    assert m.num_partial == 0  # the merger keeps no record of held requests (engine/pd.py does)


def test_failed_requests_are_the_union():
    m = RankMerger(2)
    merged = m.merge([out(0, failed_reqs={"a": "x"}), out(0, failed_reqs={"b": "y"})])
    assert merged.failed_reqs == {"a": "x", "b": "y"}


def test_a_request_one_rank_failed_fails_whatever_the_others_sampled():
    """A grammar can miss its compile deadline on one rank only (worker/grammar.py): that rank
    fails the request, the other samples it; the request fails and nothing disagrees."""
    m = RankMerger(2)
    merged = m.merge([out(0, sampled={"a": 5, "b": 7}), out(0, sampled={"b": 7}, failed_reqs={"a": "late"})])
    assert merged.sampled == {"b": 7} and merged.failed_reqs == {"a": "late"}
    with pytest.raises(RankDisagreementError, match="rank 1 sampled"):
        m.merge([out(1, sampled={"a": 5, "b": 7}), out(1, sampled={"b": 8}, failed_reqs={"a": "late"})])
