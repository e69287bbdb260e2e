"""Counters of KV transfers and fixed-bucket latency histograms, as plain data.

They live in the process that measures (a worker's NIXL connector, an engine loop) and cross
Ray as copies when `/metrics` is scraped, so the ingress renders them without any shared
state; buckets are fixed so that copies from different engines add up.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds: a page READ on one host takes well under a millisecond; across hosts, or behind a
# busy peer, tens of milliseconds; a request's phases take up to minutes under load.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket: `counts[i]` holds values <= bounds[i] and > bounds[i-1];
    the last count holds those above every bound (Prometheus' +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase strictly, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations <= it) pairs ending with +Inf, as Prometheus writes them."""
        out, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


@dataclass(slots=True)
class TransferStats:
    """A worker's KV loads: how long each took from posting to completion, what moved, what failed.
    A load counts as failed when any of its blocks was left unread (an errored, refused or
    injected-failure READ); its time and bytes are then not counted."""

    seconds: Histogram = field(default_factory=lambda: Histogram(TRANSFER_BUCKETS))
    bytes: int = 0
    descriptors: int = 0  # (buffer, block) pages moved, one NIXL descriptor each
    failed: int = 0
    corrupt: int = 0  # loads whose pages failed their --kv-verify checksums (also counted in failed)

    def copy(self) -> TransferStats:
        return TransferStats(self.seconds.copy(), self.bytes, self.descriptors, self.failed, self.corrupt)
