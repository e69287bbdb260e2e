"""The load report's picture: latency CDFs (TTFT, TPOT, ITL, end-to-end) and throughput over
the run, one line per run, so layouts can be compared at a glance."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt
import numpy as np

from bench.client import Sample
from bench.stats import timeline


def _cdf(ax: plt.Axes, values_s: Sequence[float], label: str) -> None:
    if values_s:
        ms = np.sort(np.asarray(values_s)) * 1e3
        ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=label)


def plot_runs(runs: Sequence[tuple[str, Sequence[Sample], float]], path: Path) -> None:
    """`runs`: (label, samples, duration_s) per run."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    latency = (
        ("TTFT", lambda ok: [s.ttft for s in ok]),
        ("TPOT", lambda ok: [t for s in ok if (t := s.tpot) is not None]),
        ("ITL", lambda ok: [x for s in ok for x in s.itls]),
        ("end-to-end latency", lambda ok: [s.e2e for s in ok]),
    )
    for ax, (title, values) in zip(axes.flat, latency, strict=False):
        for label, samples, _ in runs:
            _cdf(ax, values([s for s in samples if s.ok]), label)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    for label, samples, duration in runs:
        line = timeline(samples, duration)
        axes[1, 1].plot(line["t_s"], line["output_tok_per_s"], label=label)
        axes[1, 2].plot(line["t_s"], line["requests_per_s"], label=label)
    axes[1, 1].set(title="output throughput over time", xlabel="s since start", ylabel="tokens/s")
    axes[1, 2].set(title="completed requests over time", xlabel="s since start", ylabel="requests/s")
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
