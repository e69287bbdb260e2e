"""The server's side of a load run, from `/metrics` scraped before and after it: per engine, the
mean time requests spent queued, in prefill and in decode, and the KV loads (count, mean
time, bytes, pages, failures, expired leases) that happened during the run."""

from __future__ import annotations

import collections
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

Scrape = dict[tuple[str, str], float]  # (sample name, engine) -> value

PHASES = ("queue", "prefill", "decode")
_COUNTERS = {
    "kv_transfer_bytes": "raypd_kv_transfer_bytes_total",
    "kv_transfer_descriptors": "raypd_kv_transfer_descriptors_total",
    "kv_transfer_failed": "raypd_kv_transfer_failed_total",
    "kv_lease_expired": "raypd_kv_lease_expired_total",
    "prefix_cache_queries": "raypd_prefix_cache_queries_total",
    "prefix_cache_hits": "raypd_prefix_cache_hits_total",
}


def scrape(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> Scrape:
    """Every per-engine sample (histogram sums and counts, counters, gauges) of one scrape."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=timeout_s).raise_for_status().text
    values: Scrape = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "engine" in s.labels and "le" not in s.labels:
                values[(s.name, s.labels["engine"])] += s.value
    return dict(values)


def breakdown(before: Scrape, after: Scrape) -> dict[str, dict[str, float]]:
    """Per engine: what the run added to each histogram and counter, as means and totals."""

    def delta(name: str, engine: str) -> float:
        return after.get((name, engine), 0.0) - before.get((name, engine), 0.0)

    engines = sorted({engine for _, engine in after})
    out: dict[str, dict[str, float]] = {}
    for engine in engines:
        row: dict[str, float] = {}
        for phase in PHASES:
            name = f"raypd_request_{phase}_time_seconds"
            n = delta(name + "_count", engine)
            row[f"{phase}_requests"] = n
            row[f"mean_{phase}_time_ms"] = 1e3 * delta(name + "_sum", engine) / n if n else 0.0
        loads = delta("raypd_kv_transfer_seconds_count", engine)
        seconds = delta("raypd_kv_transfer_seconds_sum", engine)
        row["kv_transfer_loads"] = loads
        row["mean_kv_transfer_time_ms"] = 1e3 * seconds / loads if loads else 0.0
        for key, name in _COUNTERS.items():
            row[key] = delta(name, engine)
        row["kv_transfer_mb_per_s"] = row["kv_transfer_bytes"] / seconds / 1e6 if seconds else 0.0
        row["kv_blocks_in_use_after"] = after.get(("raypd_kv_blocks_in_use", engine), 0.0)
        row["kv_blocks_capacity"] = after.get(("raypd_kv_blocks_capacity", engine), 0.0)
        out[engine] = row
    return out


def wait_idle(url: str, api_key: str | None, timeout_s: float, poll_s: float = 0.2) -> Scrape:
    """Scrape until no engine runs a request or holds a KV block (the run's last blocks are freed
    a step after its last token), or `timeout_s` passes; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(url, api_key)
        busy = [
            v
            for (name, _), v in values.items()
            if name in ("raypd_kv_blocks_in_use", "raypd_num_requests_running", "raypd_num_requests_waiting")
        ]
        if not any(busy) or time.monotonic() > deadline:
            return values
        time.sleep(poll_s)


def pd_decisions(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, float]:
    """`raypd_pd_decisions_total` as "decision/reason" -> requests, since the server started."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=timeout_s).raise_for_status().text
    return {
        f"{s.labels['decision']}/{s.labels['reason']}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "raypd_pd_decisions_total"
    }
