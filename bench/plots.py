"""PNG plots of the benchmark results in bench/results/ (written by the benches' `--json-out`):
`kv_transfer.png` (bandwidth per size and path), `scheduler.png` (scheduling's share of a
decode step) and `peers.png` (raypd / vLLM ratios). A missing result file is skipped.

    python -m bench.plots [--results bench/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"


def kv_transfer(data: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    layouts = sorted({r["block_mib"] for r in data["rows"]})
    for path, color in zip(("memcpy", "cma", "nixl", "gloo", "ray"), ("k", "0.5", "C0", "C1", "C2"), strict=False):
        for layout, style in zip(layouts, ("-o", "--s"), strict=False):
            rows = sorted(
                (r for r in data["rows"] if r["path"] == path and r["block_mib"] == layout), key=lambda r: r["mbytes"]
            )
            ax.plot(
                [r["mbytes"] for r in rows],
                [r["gb_per_s"] for r in rows],
                style,
                color=color,
                label=f"{path} ({layout:g} MiB blocks)",
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="MB moved (one request's KV)",
        ylabel="GB/s",
        title="KV transfer prefill -> decode actor",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def scheduler(data: dict, out: Path) -> None:
    rows = data["share"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([f"{r['running']}\nblock {r['block_size']}" for r in rows], [100 * r["share"] for r in rows], color="C0")
    ax.axhline(2.0, color="C3", linestyle="--", label="target 2%")
    ax.set(
        xlabel="running requests, tokens per block",
        ylabel="% of a decode step",
        title="Scheduling share of a decode step",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def peers(data: dict, out: Path) -> None:
    keys = [k for k in data["rows"][0] if k.startswith(("offline_", "served_"))]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(data["rows"])
    for i, row in enumerate(data["rows"]):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [row[k]["ratio"] for k in keys], width, label=f"{row['model']} ({row['params_m']}M)")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks([j + width * (len(data["rows"]) - 1) / 2 for j in range(len(keys))], keys)
    ax.set(ylabel="raypd / vLLM output tok/s", title=f"raypd vs vLLM CPU, {data['threads']} thread(s) each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    for name, plot in (("kv_transfer", kv_transfer), ("scheduler", scheduler), ("peers", peers)):
        src = args.results / f"{name}.json"
        if src.is_file():
            plot(json.loads(src.read_text()), args.results / f"{name}.png")
            print(f"wrote {args.results / f'{name}.png'}")
        else:
            print(f"skipped {name}: no {src}")


if __name__ == "__main__":
    main()
