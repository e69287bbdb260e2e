"""Counted notifications on the prefill side: a request read by n decode ranks is reported
once all n notified, a plain id at once, and a count whose other readers never come is
dropped after twice the transfer timeout (kv/nixl/notif_counts.py)."""

from __future__ import annotations

import time

import pytest

from kv.nixl.notif_counts import NotifCounts, counted


def test_a_plain_id_is_read_at_once():
    counts = NotifCounts(transfer_timeout_s=1.0)
    assert counted("r", 1) == "r"
    assert counts.on_notif("r") == "r"
    assert len(counts) == 0


@pytest.mark.parametrize("readers", [2, 3, 5])
def test_a_counted_id_is_read_once_every_reader_notified(readers):
    counts = NotifCounts(transfer_timeout_s=1.0)
    r, s = counted("r", readers), counted("s", readers)
    for _ in range(readers - 1):
        assert counts.on_notif(r) is None
        assert counts.on_notif(s) is None
        assert len(counts) == 2
    assert counts.on_notif(r) == "r"
    assert len(counts) == 1
    assert counts.on_notif(s) == "s"
    assert len(counts) == 0


@pytest.mark.parametrize("text", ["a\x1fb", "a\x1f", "a\x1f-2"])
def test_a_separator_without_a_count_is_a_plain_id(text):
    assert NotifCounts(transfer_timeout_s=1.0).on_notif(text) == text


def test_an_id_holding_the_separator_is_counted_by_its_last_one():
    counts = NotifCounts(transfer_timeout_s=1.0)
    message = counted("a\x1fb", 2)
    assert counts.on_notif(message) is None
    assert counts.on_notif(message) == "a\x1fb"


def test_a_count_whose_other_readers_are_overdue_is_dropped():
    counts = NotifCounts(transfer_timeout_s=0.5)
    assert counts.on_notif(counted("r", 2)) is None
    counts.forget_stale(time.monotonic() + 0.9)  # within twice the timeout: still waiting
    assert len(counts) == 1
    counts.forget_stale(time.monotonic() + 1.5)
    assert len(counts) == 0
    # A late reader starts a new count rather than completing the dropped one.
    assert counts.on_notif(counted("r", 2)) is None
    assert counts.on_notif(counted("r", 2)) == "r"
