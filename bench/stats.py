"""A load run summarised in `vllm bench serve` terms: completed and failed requests, request,
output and total token throughput, goodput against TTFT/TPOT targets, and mean, median, p90
and p99 of TTFT, TPOT, ITL and end-to-end latency (ms)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.client import Sample

PERCENTILES = (90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    """Goodput counts the requests that meet both targets (vLLM's `--goodput ttft:MS tpot:MS`)."""

    ttft_ms: float
    tpot_ms: float

    def met(self, s: Sample) -> bool:
        tpot = s.tpot
        return 1e3 * s.ttft <= self.ttft_ms and (tpot is None or 1e3 * tpot <= self.tpot_ms)


def _dist(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    out.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def summarize(samples: Sequence[Sample], duration_s: float, slo: Slo, num_prompts: int) -> dict[str, object]:
    ok = [s for s in samples if s.ok]
    failed = collections.Counter(s.error for s in samples if not s.ok)
    output_tokens = sum(s.output_tokens for s in ok)
    input_tokens = sum(s.prompt_tokens for s in ok)
    report: dict[str, object] = {
        "num_prompts": num_prompts,
        "completed": len(ok),
        "failed": sum(failed.values()),
        "not_sent": num_prompts - len(samples),  # the run's time bound came first
        "failed_by_type": dict(sorted(failed.items())),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "request_goodput": sum(slo.met(s) for s in ok) / duration_s,
        "goodput_slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    }
    report.update(_dist("ttft", [s.ttft for s in ok]))
    report.update(_dist("tpot", [t for s in ok if (t := s.tpot) is not None]))
    report.update(_dist("itl", [x for s in ok for x in s.itls]))
    report.update(_dist("e2el", [s.e2e for s in ok]))
    return report


def timeline(samples: Sequence[Sample], duration_s: float, bins: int = 30) -> dict[str, list[float]]:
    """Output tokens per second and requests completed per second, in `bins` equal slices of the run.
    A chunk may carry several tokens (the server sends what a step made at once): each of a
    request's chunks counts for an equal share of its tokens."""
    width = max(duration_s, 1e-9) / bins
    tokens, done = np.zeros(bins), np.zeros(bins)
    for s in samples:
        if s.ok:
            share = s.output_tokens / len(s.token_times)
            for t in s.token_times:
                tokens[min(int(t / width), bins - 1)] += share
            done[min(int((s.start + s.e2e) / width), bins - 1)] += 1
    return {
        "t_s": [width * (i + 0.5) for i in range(bins)],
        "output_tok_per_s": list(tokens / width),
        "requests_per_s": list(done / width),
    }
