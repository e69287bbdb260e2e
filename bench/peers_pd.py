"""raypd's 1P1D against vLLM's own 1P1D on one host: the same random-weight checkpoints
(bench/peer_models.py: the ~19M NemotronH-style hybrid and the ~29M dense Qwen3, fp32), the
same prompts and the same streaming client (bench/peer_client.py) at 1, 8 and 32 streams:
output tokens/s, TTFT p50, TPOT p50.

- raypd: `python -m serve --prefill 1 --decode 1`, KV moved by NIXL between its workers;
- vLLM: two api_servers with `NixlConnector` (`kv_buffer_device: cpu`: KV in host memory),
  one `kv_producer` and one `kv_consumer`, behind bench/vllm_pd_proxy.py (prefill with
  `max_tokens` 1, then decode with the returned `kv_transfer_params`). Its CPU platform forces
  async scheduling off; the hybrid needs `--no-enable-prefix-caching`.

Two CPU placements (each role one compute core: prefill core 0, decode core 1):

- `shipped`: raypd without CPU flags (torch's threads, nothing bound); vLLM with each role's
  compute threads bound to its core (`VLLM_CPU_OMP_THREADS_BIND`), the rest as it ships: its
  NixlConnector moves the forward thread to the machine's last core on both servers, and
  NIXL's progress thread, created with no poll delay, spins on a core per server;
- `equal`: raypd `--prefill-worker-cpus 0 --decode-worker-cpus 1 --worker-threads 1`; vLLM's
  forward thread moved back to its role's core (what `VLLM_CPU_OMP_THREADS_BIND` asked for),
  and the threads that spin while it is idle (NIXL's progress thread; vLLM offers no setting
  to turn it off or give it a delay) put under SCHED_IDLE on that core: they get only the time
  nothing else wants, as raypd has no progress thread at all.

One system runs at a time (bench.peers `served_alone`): raypd's server is up only for its own
runs, and vLLM's servers, started once a model, are stopped (SIGSTOP) outside theirs, since as
shipped they keep the machine busy while idle.

    python -m bench.peers_pd [--models hybrid,dense] [--placement shipped,equal] [--json-out F]

Prints the CPU line, each server's placement, a table, and last a JSON line of raypd / vLLM
ratios per placement: output tok/s (`pd_c1`, `pd_c8`, `pd_c32`) and TTFT p50 (`pd_ttft_c1`,
...; below 1 is raypd faster), the geometric mean over the models, and the same per model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from actors.ports import free_port
from bench.machine import cpu_line
from bench.peer_models import make
from bench.peer_servers import REPO, Server, raypd_command, running, running_all, serving, vllm_command, vllm_env
from bench.peers import agreement, check_peer_args, positive_ints, prompts_for, served_alone

PLACEMENTS = ("shipped", "equal")
ROLE_CPU = {"prefill": 0, "decode": 1}
ROLE_KV_CACHE_GIB = 1  # each role's engine, on both sides
RAYPD_LAYOUT = {
    "shipped": ["--prefill", "1", "--decode", "1"],
    "equal": ["--prefill", "1", "--decode", "1", "--worker-threads", "1"]
    + [arg for role, cpu in ROLE_CPU.items() for arg in (f"--{role}-worker-cpus", str(cpu))],
}
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# A thread using this share of a core while its server is idle is polling, not working.
_SPINNING_SHARE = 0.3
_SPIN_WINDOW_S = 1.0


def vllm_role_args(role: str, hybrid: bool) -> list[str]:
    """The api_server flags that make it the prefill or decode side of a NIXL 1P1D."""
    transfer = {"kv_connector": "NixlConnector", "kv_role": _KV_ROLE[role], "kv_buffer_device": "cpu"}
    return ["--kv-transfer-config", json.dumps(transfer)] + (["--no-enable-prefix-caching"] if hybrid else [])


class VllmPD:
    """vLLM's prefill and decode servers (process group leaders) and their proxy's URL."""

    def __init__(self, servers: Mapping[str, int], url: str) -> None:
        self.servers = dict(servers)  # role -> pid
        self.url = url

    def pause(self) -> None:
        for pid in self.servers.values():
            os.killpg(pid, signal.SIGSTOP)

    @contextmanager
    def resumed(self) -> Iterator[str]:
        """The servers running, for as long as the block lasts; yields the proxy's URL."""
        for pid in self.servers.values():
            os.killpg(pid, signal.SIGCONT)
        try:
            yield self.url
        finally:
            self.pause()

    def placement(self) -> dict[str, dict[str, Any]]:
        """Per role: the CPUs its forward (the worker's main thread) may run on, and its
        threads that spin while the server is idle, with the share of a core each takes."""
        spinning = _spinning_threads({role: _worker_pid(pid) for role, pid in self.servers.items()})
        return {
            role: {
                "forward_cpus": sorted(os.sched_getaffinity(_worker_pid(pid))),
                "spinning_threads": {str(tid): round(share, 2) for tid, share in spinning[role].items()},
                "sched_idle_threads": sorted(
                    tid for tid in _cpu_ticks(_worker_pid(pid)) if os.sched_getscheduler(tid) == os.SCHED_IDLE
                ),
            }
            for role, pid in self.servers.items()
        }

    def place_equal(self) -> None:
        """Each role's forward on its own core; its spinning threads under SCHED_IDLE there."""
        workers = {role: _worker_pid(pid) for role, pid in self.servers.items()}
        spinning = _spinning_threads(workers)
        for role, worker in workers.items():
            os.sched_setaffinity(worker, {ROLE_CPU[role]})
            for tid in spinning[role]:
                os.sched_setaffinity(tid, {ROLE_CPU[role]})
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _worker_pid(server: int) -> int:
    """The process that runs a vLLM server's forward (named VLLM::Worker), under its api_server."""
    todo = [server]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
            return pid
        todo += _children(pid)
    raise RuntimeError(f"no VLLM::Worker process under pid {server}")


def _cpu_ticks(pid: int) -> dict[int, int]:
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


def _spinning_threads(workers: Mapping[str, int]) -> dict[str, dict[int, float]]:
    """Per role, the worker's threads (not its main one) that take over _SPINNING_SHARE of a
    core during a window in which the server serves nothing."""
    before = {role: _cpu_ticks(pid) for role, pid in workers.items()}
    time.sleep(_SPIN_WINDOW_S)
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[int, float]] = {}
    for role, pid in workers.items():
        after = _cpu_ticks(pid)
        shares = {tid: (t - before[role].get(tid, t)) / hz / _SPIN_WINDOW_S for tid, t in after.items()}
        out[role] = {tid: s for tid, s in shares.items() if tid != pid and s >= _SPINNING_SHARE}
    return out


@contextmanager
def vllm_pd(model: Path, kind: str, args: argparse.Namespace, work: Path) -> Iterator[VllmPD]:
    """vLLM's prefill and decode servers, each computing on its role's core, and the proxy;
    the servers paused once ready."""
    ports = {role: free_port() for role in ROLE_CPU}
    servers = []
    for role, cpu in ROLE_CPU.items():
        env = vllm_env(1, kv_cache_gib=ROLE_KV_CACHE_GIB) | {
            "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        extra = vllm_role_args(role, kind == "hybrid")
        cmd = vllm_command(args.vllm_python, model, kind, ports[role], args.max_num_seqs, extra)
        servers.append(Server(cmd, env, ports[role], work / f"{kind}-vllm-{role}.log"))
    proxy_port = free_port()
    proxy = [sys.executable, "-m", "bench.vllm_pd_proxy", "--port", str(proxy_port)]
    proxy += [arg for role in ROLE_CPU for arg in (f"--{role}", f"http://127.0.0.1:{ports[role]}")]
    with (
        running_all(servers) as procs,
        running(proxy, dict(os.environ), proxy_port, work / f"{kind}-vllm-proxy.log") as url,
    ):
        pd = VllmPD({role: p.pid for role, p in zip(ROLE_CPU, procs, strict=True)}, url)
        pd.pause()
        try:
            yield pd
        finally:
            for pid in pd.servers.values():  # stopped processes cannot take SIGTERM
                os.killpg(pid, signal.SIGCONT)


async def _greedy(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy completion as token ids (the bench tokenizer's words are `w<id>`)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        outs = []
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            outs.append([int(word[1:]) for word in r.json()["choices"][0]["text"].split()])
        return outs


def _raypd(
    model: Path, kind: str, args: argparse.Namespace, placement: str, work: Path
) -> Callable[[], AbstractContextManager[str]]:
    """raypd's 1P1D server in `placement`, started on a fresh port each time it is entered;
    vllm_env's offline switches, of which raypd reads none of the VLLM_* ones."""

    def command(port: int) -> list[str]:
        return raypd_command(model, kind, port, 1, args.max_num_seqs, RAYPD_LAYOUT[placement], ROLE_KV_CACHE_GIB)

    return partial(serving, command, vllm_env(1), work / f"{kind}-raypd-{placement}.log")


def bench_model(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = work / kind
    params = make(kind, model)
    print(f"== {kind}: {params / 1e6:.1f}M parameters at {model}", flush=True)
    row: dict[str, Any] = {"model": kind, "params_m": round(params / 1e6, 1)}
    with vllm_pd(model, kind, args, work) as vllm:
        for placement in args.placement:
            with vllm.resumed():
                if placement == "equal":
                    vllm.place_equal()
                row[f"vllm_placement_{placement}"] = vllm.placement()
            print(f"vLLM {placement}: {json.dumps(row[f'vllm_placement_{placement}'])}", flush=True)
            raypd = _raypd(model, kind, args, placement, work)
            if "greedy_agreement" not in row:
                prompts = prompts_for(0, args.greedy_prompts, args.prompt_len, 2)
                with raypd() as raypd_url:
                    raypd_out = asyncio.run(_greedy(raypd_url, kind, prompts, args.max_tokens))
                with vllm.resumed() as vllm_url:
                    vllm_out = asyncio.run(_greedy(vllm_url, kind, prompts, args.max_tokens))
                row["greedy_agreement"] = round(agreement(raypd_out, vllm_out), 4)
                print(f"greedy agreement raypd / vLLM: {row['greedy_agreement']:.4f}", flush=True)
            served = served_alone({"raypd": raypd, "vllm": vllm.resumed}, kind, args, args.min_requests)
            for streams in args.streams:
                ours, theirs = served["raypd"][streams], served["vllm"][streams]
                row.setdefault(f"pd_c{streams}", {})[placement] = {
                    "raypd": {k: round(v, 2) for k, v in ours.items()},
                    "vllm": {k: round(v, 2) for k, v in theirs.items()},
                }
                for engine, st in (("raypd", ours), ("vllm", theirs)):
                    print(
                        f"{placement:7s} {engine:5s} {streams:2d} streams: {st['output_tok_per_s']:8.1f} tok/s  "
                        f"TTFT {st['ttft_p50_ms']:7.1f} ms  TPOT {st['tpot_p50_ms']:6.1f} ms",
                        flush=True,
                    )
    return row


def ratios(row: Mapping[str, Any], streams: int, placement: str) -> tuple[float, float]:
    """raypd / vLLM output tok/s and TTFT p50 of one model at one stream count and placement."""
    cell = row[f"pd_c{streams}"][placement]
    ours, theirs = cell["raypd"], cell["vllm"]
    return ours["output_tok_per_s"] / theirs["output_tok_per_s"], ours["ttft_p50_ms"] / theirs["ttft_p50_ms"]


def headline(rows: Sequence[Mapping[str, Any]], streams: Sequence[int], placements: Sequence[str]) -> dict[str, Any]:
    """The last line's ratios: per stream count and placement the geometric mean over the
    models of raypd / vLLM output tok/s (`pd_c<n>`) and TTFT p50 (`pd_ttft_c<n>`), then the
    same per model (`pd_c<n>_<model>`), and the lowest greedy agreement."""
    out: dict[str, Any] = {}
    per_model: dict[str, Any] = {}
    for s in streams:
        for i, key in enumerate((f"pd_c{s}", f"pd_ttft_c{s}")):
            out[key] = {
                p: round(math.exp(statistics.fmean(math.log(ratios(r, s, p)[i]) for r in rows)), 3) for p in placements
            }
            for r in rows:
                per_model[f"{key}_{r['model']}"] = {p: round(ratios(r, s, p)[i], 3) for p in placements}
    out |= per_model
    out["greedy_agreement"] = min(r["greedy_agreement"] for r in rows)
    return out


def table(rows: Sequence[Mapping[str, Any]], streams: Sequence[int], placements: Sequence[str]) -> str:
    """A Markdown table: one line per model, placement and stream count, both systems side by side."""
    lines = [
        "| model | placement | streams | raypd tok/s | vLLM tok/s | ratio | raypd TTFT p50 ms | vLLM TTFT p50 ms "
        "| raypd TPOT p50 ms | vLLM TPOT p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for p in placements:
            for s in streams:
                cell = r[f"pd_c{s}"][p]
                ours, theirs = cell["raypd"], cell["vllm"]
                lines.append(
                    f"| {r['model']} | {p} | {s} | {ours['output_tok_per_s']:.1f} | {theirs['output_tok_per_s']:.1f} "
                    f"| {ratios(r, s, p)[0]:.2f} | {ours['ttft_p50_ms']:.1f} | {theirs['ttft_p50_ms']:.1f} "
                    f"| {ours['tpot_p50_ms']:.1f} | {theirs['tpot_p50_ms']:.1f} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=lambda t: t.split(","), default=["hybrid", "dense"])
    ap.add_argument("--placement", type=lambda t: t.split(","), default=list(PLACEMENTS))
    ap.add_argument("--streams", type=positive_ints, default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=4, help="requests per run at least (1 stream: one by one)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each system per measurement, taking turns")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--greedy-prompts", type=int, default=4, help="prompts whose greedy outputs are compared")
    ap.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--work-dir", type=Path, help="models and server logs (default: a temporary dir)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    check_peer_args(ap, args, ["hybrid", "dense"], "bench-peers-pd")
    if unknown := set(args.placement) - set(PLACEMENTS):
        ap.error(f"--placement: unknown {sorted(unknown)}; choose from {', '.join(PLACEMENTS)}")
    if (
        min(args.rounds, args.requests_per_stream, args.min_requests, args.prompt_len, args.greedy_prompts) < 1
        or args.max_tokens < 2
    ):
        ap.error(
            "--rounds, --requests-per-stream, --min-requests, --prompt-len, --greedy-prompts must be >= 1, "
            "--max-tokens >= 2"
        )
    if len(os.sched_getaffinity(0)) < len(ROLE_CPU) or not set(ROLE_CPU.values()) <= os.sched_getaffinity(0):
        ap.error(
            f"the placements need CPUs {sorted(ROLE_CPU.values())}; this process may use {sorted(os.sched_getaffinity(0))}"
        )
    args.placement = [p for p in PLACEMENTS if p in args.placement]  # shipped first: `equal` re-places vLLM
    args.max_num_seqs = max(args.streams)
    print(cpu_line(), flush=True)
    with ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raypd-peers-pd-")))
        work.mkdir(parents=True, exist_ok=True)
        rows = [bench_model(kind, args, work) for kind in args.models]
    if args.json_out:
        args.json_out.write_text(json.dumps({"placements": args.placement, "rows": rows}, indent=1))
    print(table(rows, args.streams, args.placement))
    print(json.dumps(headline(rows, args.streams, args.placement)))


if __name__ == "__main__":
    main()
