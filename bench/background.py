"""What an idle server's processes cost a forward on the cores they share: the in-process engine
of bench.real_step timed alone, then beside an idle raypd server and beside an idle vLLM server of
the same model, each started on the same cores and sent nothing.

A served raypd prefill at real size takes ~15% longer than the same prefill in process, and the
HTTP path is not where it goes (BENCHMARKS.md, "What bounds the rest"). This isolates the one thing the two differ
in, the other processes on the forward's cores: a Ray cluster (GCS, raylet, agents), Serve's
controller and proxy, raypd's controller, engine and API replica. Each Ray worker process wakes
its main thread every 10 ms to check for signals, besides its own timers and polls, and with two
compute threads on two cores every wake-up takes a core from one of them while the other waits
for it at the next OpenMP barrier (docs/design.md §14). The engine threads' involuntary context
switches per request count those preemptions.

    python -m bench.background [--model dense] [--threads 2] [--beside raypd,vllm] [--rounds 1] [--work-dir DIR]

prints the CPU line, one JSON line per run (`alone` before each server's and after the last, each
`beside_<server>` with that server up), and a last line of ratios, each setting's mean over the
mean of the runs alone: `background_<server>_ttft` and `background_<server>_tpot`. The guest's
speed drifts by several percent over minutes; `--rounds` repeats the whole sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import cpu_line
from bench.peer_models import REAL_BUILDERS, make_real
from bench.peer_servers import REPO, raypd_command, serving, vllm_command, vllm_env
from bench.real_step import add_engine_args, check_engine_args, engine_figures

SERVERS = ("raypd", "vllm")


def involuntary_switches() -> int:
    """This process's involuntary context switches so far, summed over its live threads: an
    ended thread's count leaves /proc with it, so `measure` reads this before the engine closes."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        for line in status.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def measure(model: Path, args: argparse.Namespace, setting: str) -> dict[str, Any]:
    """Best TTFT and TPOT of the in-process engine, and its preemptions per request, read
    before the engine closes (its threads' counts leave /proc with them)."""
    counts = [involuntary_switches()]
    ttft, tpot = asyncio.run(engine_figures(model, args, lambda: counts.append(involuntary_switches())))
    requests = args.repeats + 1  # engine_figures warms up with one more
    return {
        "setting": setting,
        "ttft_ms": round(ttft * 1e3, 1),
        "tpot_ms": round(tpot * 1e3, 1),
        "preemptions_per_request": round((counts[-1] - counts[0]) / requests),
    }


def server_command(name: str, model: Path, args: argparse.Namespace) -> Callable[[int], list[str]]:
    """The idle server beside the engine: one colocated raypd engine, or vLLM, both computing on
    the engine's cores (`raypd_command`, `vllm_env`) as bench.peers_real serves them."""
    kind = model.name
    if name == "raypd":
        return lambda port: raypd_command(model, kind, port, args.threads, 4)
    return lambda port: vllm_command(args.vllm_python, model, kind, port, 4)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The mean TTFT and TPOT of each server's `beside_<server>` rows over those of the
    `alone` rows."""
    by_setting: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_setting.setdefault(row["setting"], []).append(row)

    def mean(setting: str, key: str) -> float:
        return sum(r[key] for r in by_setting[setting]) / len(by_setting[setting])

    out: dict[str, float] = {}
    for setting in by_setting:
        if setting.startswith("beside_"):
            name = setting.removeprefix("beside_")
            for key, metric in (("ttft_ms", "ttft"), ("tpot_ms", "tpot")):
                out[f"background_{name}_{metric}"] = round(mean(setting, key) / mean("alone", key), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dense", help=f"one of {', '.join(REAL_BUILDERS)}")
    add_engine_args(ap)
    ap.add_argument("--beside", default="raypd,vllm", help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--rounds", type=int, default=1, help="times each server is started, a run alone before each")
    args = ap.parse_args()
    beside = args.beside.split(",")
    if args.model not in REAL_BUILDERS:
        ap.error(f"--model: unknown {args.model!r}; choose from {', '.join(REAL_BUILDERS)}")
    if unknown := [s for s in beside if s not in SERVERS]:
        ap.error(f"--beside: unknown {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    if "vllm" in beside and not args.vllm_python.is_file():
        ap.error(f"--vllm-python {args.vllm_python} does not exist: run `make bench-peers-real` to create .venv-vllm")
    check_engine_args(ap, args)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    model = args.work_dir / args.model  # bench.real_step's and bench.peers_real's layout
    make_real(args.model, model)
    print(cpu_line(), flush=True)
    rows: list[dict[str, Any]] = []

    def run(setting: str) -> None:
        rows.append(measure(model, args, setting))
        print(json.dumps(rows[-1]), flush=True)

    for _ in range(args.rounds):
        for name in beside:
            run("alone")
            with serving(
                server_command(name, model, args),
                vllm_env(args.threads),
                args.work_dir / f"background-{name}-server.log",
            ):
                run(f"beside_{name}")
    run("alone")
    print(json.dumps(ratios(rows)))


if __name__ == "__main__":
    main()
