"""The load report's arithmetic on hand-made samples, and the server breakdown on two scrapes."""

from __future__ import annotations

import pytest

from bench.client import Sample
from bench.server_metrics import breakdown
from bench.stats import Slo, summarize, timeline


def ok(start: float, ttft: float, gaps: list[float], prompt: int = 10) -> Sample:
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return Sample(start, True, "", ttft, tuple(times), times[-1] - start, prompt, len(times))


def test_summary_in_vllm_terms():
    samples = [
        ok(0.0, 0.1, [0.01] * 4),
        ok(0.5, 0.3, [0.05] * 4),
        Sample(0.2, False, "http_503"),
        Sample(0.3, False, "timeout"),
        Sample(0.4, False, "http_503"),
    ]
    r = summarize(samples, duration_s=2.0, slo=Slo(ttft_ms=200, tpot_ms=20), num_prompts=6)
    assert (r["completed"], r["failed"], r["not_sent"]) == (2, 3, 1)
    assert r["failed_by_type"] == {"http_503": 2, "timeout": 1}
    assert r["total_output_tokens"] == 10 and r["total_input_tokens"] == 20
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(5.0)
    assert r["total_token_throughput"] == pytest.approx(15.0)
    assert r["request_goodput"] == pytest.approx(0.5)  # only the first meets TTFT <= 200 ms, TPOT <= 20 ms
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(30.0)  # (40 ms / 4) and (200 ms / 4)
    assert r["median_itl_ms"] == pytest.approx(30.0)  # four 10 ms and four 50 ms gaps
    assert r["p99_itl_ms"] == pytest.approx(50.0)
    assert r["p90_e2el_ms"] == pytest.approx(140 + 0.9 * (500 - 140))


def test_an_all_failed_run_reports_zeros_not_errors():
    r = summarize([Sample(0.0, False, "connect")], 1.0, Slo(1, 1), 1)
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0.0 and r["request_goodput"] == 0.0


def test_timeline_puts_tokens_and_completions_in_their_slices():
    two_per_chunk = Sample(0.0, True, "", 0.6, (0.6, 0.7), 0.7, 5, 4)
    line = timeline([ok(0.0, 0.1, [0.1] * 3), ok(0.0, 0.9, []), two_per_chunk], duration_s=1.0, bins=2)
    assert line["output_tok_per_s"] == [8.0, 10.0]  # 4 tokens before 0.5 s, 1 + 4 after, over 0.5 s slices
    assert line["requests_per_s"] == [2.0, 4.0]


def test_breakdown_takes_the_runs_delta_per_engine():
    before = {
        ("raypd_request_queue_time_seconds_count", "d"): 2.0,
        ("raypd_request_queue_time_seconds_sum", "d"): 1.0,
        ("raypd_kv_transfer_seconds_count", "d"): 1.0,
        ("raypd_kv_transfer_seconds_sum", "d"): 0.5,
        ("raypd_kv_transfer_bytes_total", "d"): 100.0,
    }
    after = {
        **before,
        ("raypd_request_queue_time_seconds_count", "d"): 6.0,
        ("raypd_request_queue_time_seconds_sum", "d"): 3.0,
        ("raypd_kv_transfer_seconds_count", "d"): 5.0,
        ("raypd_kv_transfer_seconds_sum", "d"): 0.9,
        ("raypd_kv_transfer_bytes_total", "d"): 4_000_100.0,
        ("raypd_kv_blocks_capacity", "d"): 64.0,
    }
    row = breakdown(before, after)["d"]
    assert row["queue_requests"] == 4 and row["mean_queue_time_ms"] == pytest.approx(500.0)
    assert row["kv_transfer_loads"] == 4 and row["mean_kv_transfer_time_ms"] == pytest.approx(100.0)
    assert row["kv_transfer_mb_per_s"] == pytest.approx(10.0)
    assert row["decode_requests"] == 0 and row["mean_decode_time_ms"] == 0.0
    assert row["kv_blocks_in_use_after"] == 0 and row["kv_blocks_capacity"] == 64
