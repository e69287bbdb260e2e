"""What an idle server's processes cost a forward on the cores they share: the in-process engine
of bench.real_step timed alone, then beside an idle raypd server and beside an idle vLLM server of
the same model, each started on the same cores and sent nothing.

A served raypd prefill at real size takes ~15% longer than the same prefill in process, and the
HTTP path is not where it goes (docs/design.md §13). This isolates the one thing the two differ
in, the other processes on the forward's cores: a Ray cluster (GCS, raylet, agents), Serve's
controller and proxy, raypd's controller, engine and API replica. Each Ray worker process wakes
its main thread every 10 ms to check for signals, besides its own timers and polls, and with two
compute threads on two cores every wake-up takes a core from one of them while the other waits
for it at the next OpenMP barrier. The compute threads' involuntary context switches per
request count those preemptions.

    python -m bench.background [--model dense] [--threads 2] [--beside raypd,vllm] [--work-dir DIR]

prints the CPU line, one JSON line per setting (`alone` before and after the servers, then
`beside_<server>`), and a last line of ratios over the mean of the two `alone` runs:
`background_<server>_ttft` and `background_<server>_tpot`.
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
    """This process's involuntary context switches so far, summed over its threads (those
    that ended are not counted: the engine's threads outlive a measurement)."""
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
    """Best TTFT and TPOT of the in-process engine, and its preemptions per request."""
    before = involuntary_switches()
    ttft, tpot = asyncio.run(engine_figures(model, args))
    requests = args.repeats + 1  # engine_figures warms up with one more
    return {
        "setting": setting,
        "ttft_ms": round(ttft * 1e3, 1),
        "tpot_ms": round(tpot * 1e3, 1),
        "preemptions_per_request": round((involuntary_switches() - before) / requests),
    }


def server_command(name: str, model: Path, args: argparse.Namespace) -> Callable[[int], list[str]]:
    """The idle server beside the engine: one colocated raypd engine, or vLLM, both computing on
    the engine's cores (`raypd_command`, `vllm_env`) as bench.peers_real serves them."""
    kind = model.name
    if name == "raypd":
        return lambda port: raypd_command(model, kind, port, args.threads, 4)
    return lambda port: vllm_command(args.vllm_python, model, kind, port, 4)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each `beside_<server>` row's TTFT and TPOT over the mean of the `alone` rows."""
    alone = [r for r in rows if r["setting"] == "alone"]
    base = {k: sum(r[k] for r in alone) / len(alone) for k in ("ttft_ms", "tpot_ms")}
    out: dict[str, float] = {}
    for row in rows:
        if row["setting"].startswith("beside_"):
            name = row["setting"].removeprefix("beside_")
            out[f"background_{name}_ttft"] = round(row["ttft_ms"] / base["ttft_ms"], 3)
            out[f"background_{name}_tpot"] = round(row["tpot_ms"] / base["tpot_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dense", help=f"one of {', '.join(REAL_BUILDERS)}")
    add_engine_args(ap)
    ap.add_argument("--beside", default="raypd,vllm", help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm" / "bin" / "python")
    args = ap.parse_args()
    beside = args.beside.split(",")
    if args.model not in REAL_BUILDERS:
        ap.error(f"--model: unknown {args.model!r}; choose from {', '.join(REAL_BUILDERS)}")
    if unknown := [s for s in beside if s not in SERVERS]:
        ap.error(f"--beside: unknown {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    if "vllm" in beside and not args.vllm_python.is_file():
        ap.error(f"--vllm-python {args.vllm_python} does not exist: run `make bench-peers-real` to create .venv-vllm")
    check_engine_args(ap, args)
    model = args.work_dir / args.model  # bench.real_step's and bench.peers_real's layout
    make_real(args.model, model)
    print(cpu_line(), flush=True)
    rows = [measure(model, args, "alone")]
    print(json.dumps(rows[-1]), flush=True)
    for name in beside:
        log = args.work_dir / f"background-{name}-server.log"
        with serving(server_command(name, model, args), vllm_env(args.threads), log):
            rows.append(measure(model, args, f"beside_{name}"))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(measure(model, args, "alone"))
    print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(ratios(rows)))


if __name__ == "__main__":
    main()
