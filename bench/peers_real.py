"""raypd against vLLM CPU at the model sizes users run, and both against the machine's limit.

The checkpoints (bench/peer_models.py `make_real`, random weights, fp32, made once and kept in
the work dir): Qwen3-0.6B's shape (`dense`, 596M), a ~0.5B NemotronH-style hybrid (`hybrid`)
and a ~0.5B NemotronH with mixture-of-experts layers (`moe`, 6 of 48 experts a token; vLLM
0.32's CPU MoE refuses its ungated experts, so its figures are raypd's alone). Each is served
colocated by `python -m serve` (one engine) and by vLLM's OpenAI server on the same cores and
threads, one server up at a time on a quiet machine as in bench.peers (whose helpers run them):

- served: streaming completions (128 prompt / 32 output tokens by default) at 1, 4 and 16
  streams: output tok/s, TTFT p50, TPOT p50;
- offline: greedy generation at batch 1 and 16 (bench/raypd_offline.py, bench/vllm_offline.py),
  whose outputs give the engines' greedy agreement;
- the roofline (bench/machine.py, measured on the same cores and threads right before and
  right after each engine's 1-stream run, the mean of those: `served_alone`'s probe):
  TPOT at 1 stream over (weight bytes a decode step reads / memory read bandwidth), and TTFT
  of a prompt at 1 stream over (its FLOPs / fp32 matmul peak). 1.0 is the physical limit.

    python -m bench.peers_real [--models dense,hybrid,moe] [--threads 2] [--work-dir DIR] [--json-out F]

The CPU's model and flags come first, then a table and the roofline ratios. The last line is
JSON: `real_<model>_c<streams>` and `real_<model>_b<batch>` (raypd / vLLM output tok/s),
`real_<model>_ttft_c<streams>` (raypd / vLLM TTFT p50: below 1 is raypd faster), the roofline
ratios `real_<model>_tpot_roofline` and `real_<model>_ttft_roofline` (raypd; `_vllm` for vLLM),
`real_<model>_greedy_agreement`, and the CPU's flags. A model vLLM cannot serve has its raypd
figures under `real_<model>_raypd_*` and the reason under `real_<model>_vllm`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.machine import ModelCost, cpu_flags, cpu_line, measure, model_cost
from bench.peer_models import REAL_BUILDERS, VLLM_REFUSES, make_real
from bench.peers import Run, add_run_args, agreement, check_run_args, offline_runs, served_colocated

BATCHES = (1, 16)
ENGINES = ("raypd", "vllm")


def _tok_s(runs: list[Run]) -> float:
    return sum(len(t) for _, out in runs for t in out) / sum(w for w, _ in runs)


def bench_model(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One model: its bounds on this machine, both engines' offline and served figures."""
    model = work / kind
    params = make_real(kind, model)
    cost = model_cost(model)
    names = ("raypd",) if kind in VLLM_REFUSES else ENGINES
    print(f"== real {kind}: {params / 1e6:.1f}M parameters at {model}; engines {', '.join(names)}", flush=True)
    if kind in VLLM_REFUSES:
        print(f"   vLLM not run: {VLLM_REFUSES[kind]}", flush=True)
    row: dict[str, Any] = {
        "model": kind,
        "params_m": round(params / 1e6, 1),
        "engines": list(names),
        "weight_bytes_per_token": cost.weight_bytes_per_token,
        "prompt_gflop": round(cost.prompt_flops(args.prompt_len) / 1e9, 2),
    }
    runs = offline_runs(model, args, work, BATCHES, names)
    for b in BATCHES:
        row[f"offline_b{b}"] = {f"{e}_tok_s": round(_tok_s(runs[e][b]), 2) for e in names}
        if len(names) == 2:
            row[f"offline_b{b}"]["greedy_agreement"] = round(
                agreement(runs["raypd"][b][0][1], runs["vllm"][b][0][1]), 4
            )
    served = served_colocated(
        model, kind, args, work, names, probe=lambda: measure(cost.weight_bytes_per_token, args.threads)
    )
    for s in args.streams:
        row[f"served_c{s}"] = {e: {k: round(v, 2) for k, v in served[e][s].items()} for e in names}
    row["roofline"] = {e: roofline(row, e, cost, args.prompt_len) for e in names}
    return row


def roofline(row: dict[str, Any], engine: str, cost: ModelCost, prompt_len: int) -> dict[str, float]:
    """Engine's TPOT and TTFT p50 at 1 stream over the model's bounds on the machine measured
    around those runs (`bandwidth_gb_s`, `matmul_peak_gflop_s` of its 1-stream summary)."""
    one = row["served_c1"][engine]
    tpot_bound_ms = 1e3 * cost.tpot_bound_s(one["bandwidth_gb_s"] * 1e9)
    ttft_bound_ms = 1e3 * cost.ttft_bound_s(prompt_len, one["matmul_peak_gflop_s"] * 1e9)
    return {
        "tpot_ratio": round(one["tpot_p50_ms"] / tpot_bound_ms, 3),
        "ttft_ratio": round(one["ttft_p50_ms"] / ttft_bound_ms, 3),
        "tpot_bound_ms": round(tpot_bound_ms, 1),
        "ttft_bound_ms": round(ttft_bound_ms, 1),
    }


def _cell(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.0f}{unit}" if unit else f"{value:.2f}"


def table(rows: list[dict[str, Any]], streams: list[int]) -> list[str]:
    """One line per model and run: both engines' output tok/s and their ratio; served runs
    also TTFT and TPOT p50. `-` where vLLM did not run."""
    cols = ("model", "run", "raypd tok/s", "vLLM tok/s", "ratio", "raypd TTFT", "vLLM TTFT", "raypd TPOT", "vLLM TPOT")
    lines = ["  ".join(f"{c:>11s}" for c in cols)]
    for r in rows:
        for s in streams:
            ours, theirs = r[f"served_c{s}"]["raypd"], r[f"served_c{s}"].get("vllm", {})
            cells = (
                _cell(ours["output_tok_per_s"]),
                _cell(theirs.get("output_tok_per_s")),
                _cell(ours["output_tok_per_s"] / theirs["output_tok_per_s"] if theirs else None),
                _cell(ours["ttft_p50_ms"], " ms"),
                _cell(theirs.get("ttft_p50_ms"), " ms"),
                _cell(ours["tpot_p50_ms"], " ms"),
                _cell(theirs.get("tpot_p50_ms"), " ms"),
            )
            lines.append("  ".join(f"{c:>11s}" for c in (r["model"], f"served c{s}", *cells)))
        for b in BATCHES:
            off = r[f"offline_b{b}"]
            theirs_b = off.get("vllm_tok_s")
            ratio = _cell(off["raypd_tok_s"] / theirs_b if theirs_b else None)
            offline = (r["model"], f"offline b{b}", _cell(off["raypd_tok_s"]), _cell(theirs_b), ratio)
            lines.append("  ".join(f"{c:>11s}" for c in offline))
    return lines


def headline(rows: list[dict[str, Any]], streams: list[int]) -> dict[str, Any]:
    """The last line's keys (module docstring) from the rows."""
    out: dict[str, Any] = {}
    for r in rows:
        m = f"real_{r['model']}"
        both = len(r["engines"]) == 2
        for s in streams:
            ours = r[f"served_c{s}"]["raypd"]
            if both:
                theirs = r[f"served_c{s}"]["vllm"]
                out[f"{m}_c{s}"] = round(ours["output_tok_per_s"] / theirs["output_tok_per_s"], 3)
                out[f"{m}_ttft_c{s}"] = round(ours["ttft_p50_ms"] / theirs["ttft_p50_ms"], 3)
            else:
                out[f"{m}_raypd_c{s}_tok_s"] = ours["output_tok_per_s"]
                out[f"{m}_raypd_ttft_c{s}_ms"] = ours["ttft_p50_ms"]
        for b in BATCHES:
            off = r[f"offline_b{b}"]
            if both:
                out[f"{m}_b{b}"] = round(off["raypd_tok_s"] / off["vllm_tok_s"], 3)
            else:
                out[f"{m}_raypd_b{b}_tok_s"] = off["raypd_tok_s"]
        for engine, ratios in r["roofline"].items():
            suffix = "" if engine == "raypd" else f"_{engine}"
            out |= {f"{m}_{k}_roofline{suffix}": ratios[f"{k}_ratio"] for k in ("tpot", "ttft")}
        if both:
            out[f"{m}_greedy_agreement"] = min(r[f"offline_b{b}"]["greedy_agreement"] for b in BATCHES)
        else:
            out[f"{m}_vllm"] = f"not run: {VLLM_REFUSES[r['model']]}"
    out["cpu"] = cpu_line()
    out["cpu_flags"] = [f for f, have in cpu_flags().items() if have]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=lambda t: t.split(","), default=list(REAL_BUILDERS))
    add_run_args(ap, threads=2, streams=[1, 4, 16], requests_per_stream=1, rounds=1, batch1_prompts=2, max_tokens=32)
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "raypd-peers-real",
        help="checkpoints (made once, ~2 GB each, kept), prompts and server logs",
    )
    args = ap.parse_args()
    check_run_args(ap, args, list(REAL_BUILDERS), "bench-peers-real")
    if 1 not in args.streams:
        ap.error("--streams must include 1: the roofline ratios are taken at one stream")
    print(cpu_line(), flush=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rows = [bench_model(kind, args, args.work_dir) for kind in args.models]
    print("\n".join(table(rows, args.streams)))
    for r in rows:
        for engine, ratios in r["roofline"].items():
            one = r["served_c1"][engine]
            print(
                f"roofline {r['model']:6s} {engine:5s}: TPOT / bound {ratios['tpot_ratio']:.2f} "
                f"(bound {ratios['tpot_bound_ms']:.0f} ms: {r['weight_bytes_per_token'] / 1e9:.2f} GB at "
                f"{one['bandwidth_gb_s']:.1f} GB/s), TTFT / bound {ratios['ttft_ratio']:.2f} "
                f"(bound {ratios['ttft_bound_ms']:.0f} ms: {r['prompt_gflop']:.1f} GFLOP at "
                f"{one['matmul_peak_gflop_s']:.0f} GFLOP/s)"
            )
    for r in rows:
        if "greedy_agreement" in r["offline_b1"]:
            shares = ", ".join(f"batch {b} {r[f'offline_b{b}']['greedy_agreement']:.4f}" for b in BATCHES)
            print(f"greedy agreement {r['model']}: {shares}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"threads": args.threads, "cpu": cpu_line(), "rows": rows}, indent=1))
    print(json.dumps(headline(rows, args.streams)))


if __name__ == "__main__":
    main()
