"""The autoscaler's decisions (serve/autoscale.py): load measured from real `EngineStats` shapes,
its pressure against the targets, and hysteresis that neither flaps nor leaves the range."""

from __future__ import annotations

import pytest

from engine.config import Config
from engine.messages import EngineStats
from kv.nixl.transfer_stats import PHASE_BUCKETS, Histogram
from serve.autoscale import DOWN_FRACTION, Hysteresis, RoleLoad, Sample, Targets, measure, pressure

TARGETS = Targets(prefill_waiting=4, prefill_ttft_s=2.0, decode_itl_s=0.2, decode_kv_fraction=0.8)


def _stats(running=0, waiting=0, free=100, steps=0, ttfts=()) -> EngineStats:
    queue, prefill = Histogram(PHASE_BUCKETS), Histogram(PHASE_BUCKETS)
    for t in ttfts:
        queue.observe(t / 2)
        prefill.observe(t / 2)
    phases = {"queue": queue, "prefill": prefill, "decode": Histogram(PHASE_BUCKETS)}
    return EngineStats(running, waiting, 100, free, 0, 0, {"steps": steps, "phases": phases})


def test_prefill_is_measured_by_its_queue_and_the_ttft_of_requests_since_the_last_look():
    before = {"p0": Sample(10.0, _stats(ttfts=[5.0]))}
    now = {"p0": Sample(11.0, _stats(waiting=6, ttfts=[5.0, 1.0, 3.0])), "p1": Sample(11.0, _stats(waiting=2))}
    load = measure("prefill", now, before)
    assert load.waiting_per_engine == 4
    assert load.ttft_s == pytest.approx(2.0)  # the two requests since, not the old 5 s one
    assert pressure("prefill", load, TARGETS) == pytest.approx(1.0)


def test_decode_is_measured_by_its_step_time_while_busy_and_its_kv_in_use():
    before = {"d0": Sample(10.0, _stats(steps=100)), "d1": Sample(10.0, _stats(steps=7))}
    now = {"d0": Sample(12.0, _stats(running=3, free=40, steps=120)), "d1": Sample(12.0, _stats(steps=7))}
    load = measure("decode", now, before)
    assert load.itl_s == pytest.approx(0.1)  # d1 ran nothing: not a step time
    assert load.kv_fraction == pytest.approx(0.3)
    assert pressure("decode", load, TARGETS) == pytest.approx(0.5)
    assert pressure("decode", RoleLoad(kv_fraction=0.9), TARGETS) > 1


def test_an_idle_role_has_no_pressure():
    assert pressure("prefill", measure("prefill", {}, {}), TARGETS) == 0
    assert pressure("decode", measure("decode", {"d0": Sample(1.0, _stats())}, {}), TARGETS) == 0


def test_up_after_the_delay_above_target_one_step_at_a_time_and_never_past_the_max():
    h = Hysteresis(1, 3, up_delay_s=5, down_delay_s=20)
    assert [h.decide(1, 2.0, t) for t in (0, 2, 4)] == [0, 0, 0]
    assert h.decide(1, 2.0, 5) == 1
    assert h.decide(2, 2.0, 6) == 0  # the clock starts again after a decision
    assert h.decide(2, 2.0, 11) == 1
    assert [h.decide(3, 5.0, t) for t in (12, 30, 60)] == [0, 0, 0]  # at the max


def test_the_band_between_the_thresholds_changes_nothing_and_resets_the_clocks():
    h = Hysteresis(1, 3, up_delay_s=5, down_delay_s=5)
    assert h.decide(2, 2.0, 0) == 0
    assert h.decide(2, 0.8, 4) == 0  # within the band: the time above is forgotten
    assert h.decide(2, 2.0, 6) == 0
    assert h.decide(2, DOWN_FRACTION / 2, 8) == 0
    assert h.decide(2, 0.9, 12) == 0
    assert h.decide(2, DOWN_FRACTION / 2, 13) == 0
    assert h.decide(2, DOWN_FRACTION / 2, 18) == -1


def test_down_never_below_the_min_and_a_count_outside_the_range_is_brought_back():
    h = Hysteresis(2, 4, up_delay_s=0, down_delay_s=0)
    assert h.decide(2, 0.0, 0) == 0
    assert h.decide(1, 0.0, 1) == 1
    assert h.decide(5, 2.0, 2) == -1


def test_targets_come_from_the_config():
    cfg = Config(scale_prefill_ttft_ms=1500, scale_decode_itl_ms=50, scale_decode_kv_percent=90)
    assert Targets.of(cfg) == Targets(4, 1.5, 0.05, 0.9)
