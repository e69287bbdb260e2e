"""Prometheus metrics of the ingress and of its engines, on a registry the app owns.

Request metrics are recorded as requests run. Engine metrics (queues, KV blocks, the
zero-list counters) live in the engines, so they are fetched from `stats()` when `/metrics`
is scraped: a gauge is then never older than the scrape, and an idle engine shows 0 blocks
in use rather than whatever the last request left behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from api.router import Router
from engine.messages import EngineStats
from engine.phases import PHASES
from kv.nixl import transfer_stats

STATS_TIMEOUT_S = 1.0
OUTCOMES = ("success", "rejected", "overloaded", "aborted", "error")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Engine metrics from the stats fetched for the current scrape."""

    def __init__(self) -> None:
        self.snapshot: dict[str, EngineStats] = {}
        self.resumed = 0  # the router's count at the scrape
        self.decisions: dict[tuple[str, str], int] = {}  # PD: (decision, reason) -> requests

    def collect(self) -> Iterator[Metric]:
        families = (
            (
                GaugeMetricFamily,
                "raypd_num_requests_running",
                "Requests the engine is running.",
                lambda s: s.num_running,
            ),
            (
                GaugeMetricFamily,
                "raypd_num_requests_waiting",
                "Requests waiting for the engine to take them.",
                lambda s: s.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "raypd_kv_blocks_in_use",
                "KV cache blocks allocated (0 when idle).",
                lambda s: s.num_blocks_total - s.num_blocks_free,
            ),
            (
                GaugeMetricFamily,
                "raypd_kv_blocks_capacity",
                "KV cache blocks in the engine's pool (total).",
                lambda s: s.num_blocks_total,
            ),
            (
                CounterMetricFamily,
                "raypd_prefix_cache_queries",
                "Prompt tokens looked up in the engine's prefix cache.",
                lambda s: s.extra.get("prefix_cache_queries", 0),
            ),
            (
                CounterMetricFamily,
                "raypd_prefix_cache_hits",
                "Prompt tokens found in the engine's prefix cache (not computed).",
                lambda s: s.extra.get("prefix_cache_hits", 0),
            ),
            (
                CounterMetricFamily,
                "raypd_prefix_cache_loaded",
                "Prompt tokens a decode engine loaded from a prefill engine, past its own prefix hit.",
                lambda s: s.extra.get("loaded_tokens", 0),
            ),
            (
                CounterMetricFamily,
                "raypd_kv_blocks_zeroed",
                "Attention blocks zeroed on allocation.",
                lambda s: s.blocks_zeroed,
            ),
            (
                CounterMetricFamily,
                "raypd_kv_blocks_zero_skipped",
                "Newly allocated attention blocks not zeroed because a KV load covers them.",
                lambda s: s.blocks_skipped,
            ),
        )
        for family, name, doc, value in families:
            metric = family(name, doc, labels=["engine"])
            for engine, stats in self.snapshot.items():
                metric.add_metric([engine], value(stats))
            yield metric
        yield CounterMetricFamily(
            "raypd_requests_resumed", "Engine requests resumed on another engine after theirs was lost.", self.resumed
        )
        decisions = CounterMetricFamily(
            "raypd_pd_decisions",
            "PD requests by where their prompt was computed: on a prefill engine (remote) or on "
            "their decode engine (local), and why (api/routing/disagg.py).",
            labels=["decision", "reason"],
        )
        for (decision, reason), n in sorted(self.decisions.items()):
            decisions.add_metric([decision, reason], n)
        yield decisions
        yield from self._kv_transfers()
        yield from self._phases()

    def _kv_transfers(self) -> Iterator[Metric]:
        """The NIXL connector's loads, summed over an engine's workers (decode engines load)."""
        seconds = HistogramMetricFamily(
            "raypd_kv_transfer_seconds",
            "Time of a KV load from posting the NIXL READ to its completion.",
            labels=["engine"],
        )
        counters = (
            ("raypd_kv_transfer_bytes", "Bytes moved by completed KV loads.", lambda t: t.bytes),
            (
                "raypd_kv_transfer_descriptors",
                "Pages (NIXL descriptors) moved by completed KV loads.",
                lambda t: t.descriptors,
            ),
            ("raypd_kv_transfer_failed", "KV loads that left blocks unread.", lambda t: t.failed),
        )
        families = [(CounterMetricFamily(name, doc, labels=["engine"]), value) for name, doc, value in counters]
        expired = CounterMetricFamily(
            "raypd_kv_lease_expired",
            "KV loads given up because the prefill engine's lease on the KV ran out first.",
            labels=["engine"],
        )
        for engine, stats in self.snapshot.items():
            transfers: list[transfer_stats.TransferStats] = stats.extra.get("kv_transfer", [])
            if transfers:
                _add_histogram(seconds, engine, [t.seconds for t in transfers])
                for family, value in families:
                    family.add_metric([engine], sum(value(t) for t in transfers))
            expired.add_metric([engine], stats.extra.get("expired_leases", 0))
        yield seconds
        yield from (family for family, _ in families)
        yield expired

    def _phases(self) -> Iterator[Metric]:
        """Where requests spent their time inside each engine (engine/phases.py)."""
        for phase in PHASES:
            family = HistogramMetricFamily(
                f"raypd_request_{phase}_time_seconds",
                f"Time requests spent in the {phase} phase in an engine.",
                labels=["engine"],
            )
            for engine, stats in self.snapshot.items():
                if (histogram := stats.extra.get("phases", {}).get(phase)) is not None:
                    _add_histogram(family, engine, [histogram])
            yield family


def _add_histogram(family: HistogramMetricFamily, engine: str, parts: list[transfer_stats.Histogram]) -> None:
    """One labelled histogram from same-bucket parts (an engine's workers)."""
    buckets = [(bound, sum(p.cumulative()[i][1] for p in parts)) for i, (bound, _) in enumerate(parts[0].cumulative())]
    family.add_metric([engine], buckets, sum(p.total for p in parts))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "raypd_requests",
            "HTTP requests to the generation endpoints by outcome.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "raypd_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "raypd_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "raypd_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("raypd_prompt_tokens", "Prompt tokens of requests served.", registry=r)
        self.generation_tokens = Counter("raypd_generation_tokens", "Tokens generated.", registry=r)
        self._engines = _EngineCollector()
        r.register(self._engines)

    async def render(self, router: Router) -> bytes:
        self._engines.snapshot = await router.stats(STATS_TIMEOUT_S)
        self._engines.resumed = router.num_resumed
        self._engines.decisions = dict(router.decisions)
        return generate_latest(self.registry)


class RequestTimer:
    """Latency metrics of one engine request (one choice)."""

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        """`n` tokens arrived now; tokens that arrive together share the gap since the last ones."""
        if n == 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - self.last) / n)
        self.last = now

    def finish(self) -> None:
        if self.last is not None:
            self.metrics.e2e.observe(self.last - self.arrival)
