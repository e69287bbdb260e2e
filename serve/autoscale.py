"""When to add or drain an engine of a role: load measured from engine stats, against targets,
with hysteresis (docs/design.md §23).

Each role is measured on its own. A prefill engine's work is its queue and how long a request
takes to its hand-over, so prefill is measured by requests waiting per engine and by the mean
time to first token (the queue and prefill phases of the requests that ended since the last
look). A decode engine's work is its running batch, so decode is measured by the mean time of a
step while it has requests running (each running request gets one token per step: the
inter-token latency) and by the share of KV blocks in use. `pressure` is the largest ratio of a
measure to its target: above 1 the role wants another engine, below `DOWN_FRACTION` it has one
too many.

Hysteresis: a role must stay above its targets for `up_delay_s` before an engine is added, and
below `DOWN_FRACTION` of every one for `down_delay_s` before one is drained; between the two
nothing changes, each decision starts both clocks again, and one engine is added or drained at
a time, so a new engine's effect is seen before the next decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.config import Config
from engine.messages import EngineStats

DOWN_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class Targets:
    prefill_waiting: float
    prefill_ttft_s: float
    decode_itl_s: float
    decode_kv_fraction: float

    @classmethod
    def of(cls, cfg: Config) -> Targets:
        return cls(
            cfg.scale_prefill_waiting,
            cfg.scale_prefill_ttft_ms / 1000,
            cfg.scale_decode_itl_ms / 1000,
            cfg.scale_decode_kv_percent / 100,
        )


@dataclass(frozen=True, slots=True)
class Sample:
    """One engine's stats and when they were taken (the controller's clock)."""

    at: float
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """A role's measures over its serving engines; None where nothing was measured."""

    waiting_per_engine: float = 0.0
    ttft_s: float | None = None
    itl_s: float | None = None
    kv_fraction: float = 0.0


def _phase_totals(stats: EngineStats) -> tuple[int, float]:
    """(requests, seconds) to first token observed so far: the queue and prefill phases."""
    phases = stats.extra.get("phases") or {}
    queue, prefill = phases.get("queue"), phases.get("prefill")
    if queue is None or prefill is None:
        return 0, 0.0
    return prefill.count, queue.total + prefill.total


def measure(role: str, now: Mapping[str, Sample], before: Mapping[str, Sample]) -> RoleLoad:
    """The load of a role's engines from their stats `now` and at the last look (`before`)."""
    if not now:
        return RoleLoad()
    waiting = sum(s.stats.num_waiting for s in now.values()) / len(now)
    kv = sum(1 - s.stats.num_blocks_free / max(1, s.stats.num_blocks_total) for s in now.values()) / len(now)
    if role == "prefill":
        done = seconds = 0.0
        for name, s in now.items():
            if name in before:
                count, total = _phase_totals(s.stats)
                count0, total0 = _phase_totals(before[name].stats)
                done += count - count0
                seconds += total - total0
        return RoleLoad(waiting, seconds / done if done > 0 else None, None, kv)
    itls = []
    for name, s in now.items():
        prev = before.get(name)
        if prev is None or s.stats.num_running == 0:
            continue
        steps = s.stats.extra.get("steps", 0) - prev.stats.extra.get("steps", 0)
        if steps > 0:
            itls.append((s.at - prev.at) / steps)
    return RoleLoad(waiting, None, sum(itls) / len(itls) if itls else None, kv)


def pressure(role: str, load: RoleLoad, targets: Targets) -> float:
    """The largest ratio of a measure to its target (0 when the role is idle)."""
    if role == "prefill":
        ratios = [load.waiting_per_engine / targets.prefill_waiting]
        if load.ttft_s is not None:
            ratios.append(load.ttft_s / targets.prefill_ttft_s)
    else:
        ratios = [load.kv_fraction / targets.decode_kv_fraction]
        if load.itl_s is not None:
            ratios.append(load.itl_s / targets.decode_itl_s)
    return max(ratios)


class Hysteresis:
    """One role's decisions: +1 (add an engine), -1 (drain one) or 0."""

    def __init__(self, lo: int, hi: int, up_delay_s: float, down_delay_s: float) -> None:
        self.lo, self.hi = lo, hi
        self.up_delay_s, self.down_delay_s = up_delay_s, down_delay_s
        self._above_since: float | None = None
        self._below_since: float | None = None

    def decide(self, count: int, pressure: float, now: float) -> int:
        """`count`: the role's engines serving (draining ones excluded)."""
        if count < self.lo:
            return 1
        if count > self.hi:
            return -1
        if pressure > 1:
            self._above_since = self._above_since if self._above_since is not None else now
            self._below_since = None
        elif pressure < DOWN_FRACTION:
            self._below_since = self._below_since if self._below_since is not None else now
            self._above_since = None
        else:
            self._above_since = self._below_since = None
        if self._above_since is not None and now - self._above_since >= self.up_delay_s and count < self.hi:
            self._above_since = None
            return 1
        if self._below_since is not None and now - self._below_since >= self.down_delay_s and count > self.lo:
            self._below_since = None
            return -1
        return 0
