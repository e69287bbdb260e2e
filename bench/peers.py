"""raypd against vLLM CPU on the same cores: the same random-weight checkpoints
(bench/peer_models.py: a ~19M NemotronH-style hybrid and a ~29M dense Qwen3, fp32), the
same compute threads, the same prompts and the same load client.

- offline: output tokens/s of greedy generation at batch 1 (prompts one after another)
  and batch 32 (one batch), raypd's in-process engine (bench/raypd_offline.py) against
  `vllm.LLM` (bench/vllm_offline.py), each in a process and session of its own;
- served: `python -m serve` (one colocated engine) against vLLM's OpenAI server, streaming
  completions at 1, 8 and 32 concurrent streams: output tokens/s, TTFT, TPOT, ITL.

Only one engine is up at a time (`served_alone`: an idle server's background processes would
slow the other's runs); the offline runs alternate, and the served ones take turns, raypd's
server then vLLM's, `--rounds` times each. Each run starts once the machine is quiet: vLLM's
worker busy-polls a core for about a second after its last request, which would otherwise land
on the run after it. vLLM runs from its own virtual
environment (`make bench-peers` creates `.venv-vllm`).

    python -m bench.peers [--models hybrid,dense] [--threads 1] [--work-dir DIR]

Whether the greedy tokens of both engines agree is reported per model. The last line is
JSON: raypd / vLLM ratios (`offline_b1`, `offline_b32`, `served_c8`, `served_c32`), the
geometric mean over the models, and the same per model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

from bench.machine import Measured
from bench.peer_client import Sample, drive
from bench.peer_models import VOCAB, make
from bench.peer_servers import KV_CACHE_GIB, REPO, raypd_command, serving, vllm_command, vllm_env

BATCHES = (1, 32)
_OFFLINE_TIMEOUT_S = 900.0
# Busy cores below which the machine counts as quiet: both engines idle take ~0.25 (Ray's
# background, vLLM's server); a spinning worker takes a whole one.
_QUIET_CORES = 0.5
_QUIET_WINDOW_S = 0.5
_SETTLE_TIMEOUT_S = 20.0
Run = tuple[float, list[list[int]]]  # seconds, output token ids


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def settle() -> None:
    """Wait until the machine has been quiet for one window (or give up after a while)."""
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + _SETTLE_TIMEOUT_S
    busy, total = _busy_jiffies()
    while True:
        time.sleep(_QUIET_WINDOW_S)
        b, t = _busy_jiffies()
        if (b - busy) / max(t - total, 1) * cores < _QUIET_CORES:
            return
        if time.monotonic() > deadline:
            print(f"warning: the machine stayed busy for {_SETTLE_TIMEOUT_S:.0f} s before a run", flush=True)
            return
        busy, total = b, t


def prompts_for(batch: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1000 + batch)
    return [[rng.randrange(1, VOCAB - 1) for _ in range(length)] for _ in range(count)]


class _OfflineEngine:
    """`bench/vllm_offline.py` or `bench/raypd_offline.py` in a process and session of its
    own (Linux shares CPU time fairly between sessions): one stdin command per run."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], work: Path) -> None:
        self.work = work
        self.name = name
        self.log = work / f"{name}-offline.log"
        self._count = 0
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )

    def run(self, prompts: list[list[int]], batch: int, max_tokens: int) -> Run:
        self._count += 1
        out = self.work / f"{self.name}-offline-{self._count}.json"
        out.unlink(missing_ok=True)  # an earlier run's result in a reused --work-dir is not this one's
        assert self.proc.stdin is not None
        cmd = {"prompts": prompts, "batch": batch, "max_tokens": max_tokens, "out": str(out)}
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + _OFFLINE_TIMEOUT_S  # the first command waits for the start-up too
        while not out.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} offline process exited with {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} offline run took over {_OFFLINE_TIMEOUT_S:.0f} s; see {self.log}")
            time.sleep(0.05)
        data = json.loads(out.read_text())
        return data["wall_s"], data["token_ids"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def offline_runs(
    model: Path,
    args: argparse.Namespace,
    work: Path,
    batches: tuple[int, ...] = BATCHES,
    names: tuple[str, ...] = ("raypd", "vllm"),
) -> dict[str, dict[int, list[Run]]]:
    """The offline processes of engines `names` (both by default), runs alternating; per
    engine and batch size the (seconds, outputs) of every round."""
    by_batch = {b: prompts_for(b, args.batch1_prompts if b == 1 else b, args.prompt_len, 0) for b in batches}
    seqs = str(max(batches))
    env = vllm_env(args.threads)
    cmds = {
        "raypd": [
            sys.executable,
            "-m",
            "bench.raypd_offline",
            "--model",
            str(model),
            "--max-num-seqs",
            seqs,
            "--threads",
            str(args.threads),
            "--kv-cache-gib",
            str(KV_CACHE_GIB),
        ],
        "vllm": [
            str(args.vllm_python),
            str(REPO / "bench" / "vllm_offline.py"),
            "--model",
            str(model),
            "--max-num-seqs",
            seqs,
        ],
    }
    engines = {name: _OfflineEngine(f"{model.name}-{name}", cmds[name], env, work) for name in names}
    runs: dict[str, dict[int, list[Run]]] = {e: {b: [] for b in batches} for e in engines}
    try:
        for b, prompts in by_batch.items():  # warm-up
            for engine in engines.values():
                engine.run(prompts[:b], b, 4)
        for _ in range(args.rounds):
            for b, prompts in by_batch.items():
                for name, engine in engines.items():
                    settle()
                    runs[name][b].append(engine.run(prompts, b, args.max_tokens))
    finally:
        for engine in engines.values():
            engine.close()
    return runs


def served_colocated(
    model: Path,
    kind: str,
    args: argparse.Namespace,
    log_dir: Path,
    names: Sequence[str] = ("raypd", "vllm"),
    probe: Callable[[], Measured] | None = None,
) -> dict[str, dict[int, dict[str, float]]]:
    """The colocated servers of engines `names`, each up alone in turn (`served_alone`, which
    runs `probe` around the 1-stream runs), in that order, `--rounds` times; each server's log
    is `log_dir/{kind}-{name}-server.log`."""
    commands: dict[str, Callable[[int], list[str]]] = {
        "raypd": lambda port: raypd_command(model, kind, port, args.threads, max(args.streams)),
        "vllm": lambda port: vllm_command(args.vllm_python, model, kind, port, max(args.streams)),
    }
    env = vllm_env(args.threads)
    servers = {name: partial(serving, commands[name], env, log_dir / f"{kind}-{name}-server.log") for name in names}
    return served_alone(servers, kind, args, probe=probe)


def served_alone(
    servers: Mapping[str, Callable[[], AbstractContextManager[str]]],
    model: str,
    args: argparse.Namespace,
    min_requests: int = 0,
    probe: Callable[[], Measured] | None = None,
) -> dict[str, dict[int, dict[str, float]]]:
    """`args.rounds` times, each server in turn brought up by `servers[name]()` (a context
    manager yielding its base URL), driven at each of `args.streams` (every run started on a
    quiet machine, `args.requests_per_stream` requests a stream and at least `min_requests`),
    then brought down before the next comes up; per server and stream count the summary of its
    rounds.

    `probe` measures the machine (bench/machine.py) right before and right after each 1-stream
    run, the server up and idle; the mean of a server's probes joins its 1-stream summary as
    `bandwidth_gb_s` and `matmul_peak_gflop_s`, the machine those runs had. A guest's memory
    bandwidth can change by half within a minute and back (33 and 59 GB/s on one guest, the
    1-stream TPOT following it): a bound measured minutes away from the run held it to another
    machine.

    Never two servers up at once: an idle raypd keeps a dozen Ray processes that wake on timers
    (~15% of a core together), and beside it vLLM's real-size decode step took 164 ms instead of
    118 (raypd's 153 instead of 141 beside an idle vLLM): the runs measured the neighbour too."""
    samples: dict[str, dict[int, tuple[list[Sample], float]]] = {
        e: {s: ([], 0.0) for s in args.streams} for e in servers
    }
    probes: dict[str, list[Measured]] = {e: [] for e in servers}
    for _ in range(args.rounds):
        for engine, up in servers.items():
            with up() as url:
                for streams in args.streams:
                    count = max(streams * args.requests_per_stream, min_requests)
                    prompts = prompts_for(streams, count, args.prompt_len, 1)
                    settle()
                    bracket = probe is not None and streams == 1
                    if bracket:
                        probes[engine].append(probe())
                    got, wall = asyncio.run(drive(url, model, prompts, streams, args.max_tokens))
                    if bracket:
                        probes[engine].append(probe())
                    prev, prev_wall = samples[engine][streams]
                    samples[engine][streams] = (prev + got, prev_wall + wall)
    out = {e: {s: summary(*v) for s, v in by_streams.items()} for e, by_streams in samples.items()}
    for engine, measured in probes.items():
        if measured:
            out[engine][1] |= {
                "bandwidth_gb_s": statistics.fmean(m.bandwidth_bytes_s for m in measured) / 1e9,
                "matmul_peak_gflop_s": statistics.fmean(m.matmul_peak_flops for m in measured) / 1e9,
            }
    return out


def summary(samples: list[Sample], wall: float) -> dict[str, float]:
    tpot = [(s.e2e - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    itl = [x for s in samples for x in s.itls]
    return {
        "output_tok_per_s": sum(s.tokens for s in samples) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(s.ttft for s in samples),
        "tpot_p50_ms": 1e3 * statistics.median(tpot),
        "itl_p50_ms": 1e3 * statistics.median(itl),
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each output that matches up to the first differing token."""
    shares = []
    for x, y in zip(a, b, strict=False):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        shares.append(same / max(len(x), len(y), 1))
    return statistics.fmean(shares)


def bench_model(kind: str, args: argparse.Namespace, work: Path) -> dict[str, object]:
    model = work / kind
    params = make(kind, model)
    print(f"== {kind}: {params / 1e6:.1f}M parameters at {model}", flush=True)
    runs = offline_runs(model, args, work)
    row: dict[str, object] = {"model": kind, "params_m": round(params / 1e6, 1)}
    for b in BATCHES:
        tps = {e: sum(len(t) for _, out in runs[e][b] for t in out) / sum(w for w, _ in runs[e][b]) for e in runs}
        agree = agreement(runs["raypd"][b][0][1], runs["vllm"][b][0][1])
        row[f"offline_b{b}"] = {
            "raypd_tok_s": round(tps["raypd"], 1),
            "vllm_tok_s": round(tps["vllm"], 1),
            "ratio": round(tps["raypd"] / tps["vllm"], 3),
            "greedy_agreement": round(agree, 4),
        }
        print(
            f"offline batch {b:2d}: raypd {tps['raypd']:8.1f} tok/s  vLLM {tps['vllm']:8.1f} tok/s  "
            f"ratio {tps['raypd'] / tps['vllm']:.2f}  greedy agreement {agree:.4f}",
            flush=True,
        )
    served = served_colocated(model, kind, args, work)
    for streams in args.streams:
        ours, theirs = served["raypd"][streams], served["vllm"][streams]
        row[f"served_c{streams}"] = {
            "raypd": {k: round(v, 2) for k, v in ours.items()},
            "vllm": {k: round(v, 2) for k, v in theirs.items()},
            "ratio": round(ours["output_tok_per_s"] / theirs["output_tok_per_s"], 3),
        }
        for engine, st in (("raypd", ours), ("vllm", theirs)):
            print(
                f"served {engine:5s} {streams:2d} streams: {st['output_tok_per_s']:8.1f} tok/s  "
                f"TTFT {st['ttft_p50_ms']:7.1f} ms  TPOT {st['tpot_p50_ms']:6.1f} ms  ITL {st['itl_p50_ms']:6.1f} ms",
                flush=True,
            )
    return row


def positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, comma-separated")
    return values


def add_run_args(
    ap: argparse.ArgumentParser,
    *,
    threads: int,
    streams: list[int],
    requests_per_stream: int,
    rounds: int,
    batch1_prompts: int,
    max_tokens: int,
) -> None:
    """The options bench.peers and bench.peers_real share; their defaults differ (a real-size
    model makes a token a hundred times slower)."""
    ap.add_argument("--threads", type=int, default=threads, help="compute threads of each engine")
    ap.add_argument("--streams", type=positive_ints, default=streams)
    ap.add_argument("--requests-per-stream", type=int, default=requests_per_stream)
    ap.add_argument("--rounds", type=int, default=rounds, help="runs of each engine per measurement, taking turns")
    ap.add_argument(
        "--batch1-prompts", type=int, default=batch1_prompts, help="prompts run one after another at batch 1"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--json-out", type=Path)


def check_peer_args(ap: argparse.ArgumentParser, args: argparse.Namespace, models: list[str], make_target: str) -> None:
    """Refuse a model not in `models` and a missing vLLM venv (naming the make target that
    creates it): what every comparison with vLLM checks first."""
    if unknown := set(args.models) - set(models):
        ap.error(f"--models: unknown {sorted(unknown)}; choose from {', '.join(models)}")
    if not args.vllm_python.is_file():
        ap.error(f"--vllm-python {args.vllm_python} does not exist: run `make {make_target}` to create .venv-vllm")


def check_run_args(ap: argparse.ArgumentParser, args: argparse.Namespace, models: list[str], make_target: str) -> None:
    """`check_peer_args`, and refuse what `add_run_args` added out of range."""
    check_peer_args(ap, args, models, make_target)
    if (
        min(args.threads, args.rounds, args.requests_per_stream, args.batch1_prompts, args.prompt_len) < 1
        or args.max_tokens < 2
    ):
        ap.error(
            "--threads, --rounds, --requests-per-stream, --batch1-prompts, --prompt-len must be >= 1, --max-tokens >= 2"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=lambda t: t.split(","), default=["hybrid", "dense"])
    add_run_args(ap, threads=1, streams=[1, 8, 32], requests_per_stream=2, rounds=2, batch1_prompts=4, max_tokens=64)
    ap.add_argument("--work-dir", type=Path, help="models, prompts and server logs (default: a temporary dir)")
    args = ap.parse_args()
    check_run_args(ap, args, ["hybrid", "dense"], "bench-peers")
    with tempfile.TemporaryDirectory(prefix="raypd-peers-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [bench_model(kind, args, work) for kind in args.models]
    if args.json_out:
        args.json_out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))
    keys = [f"offline_b{b}" for b in BATCHES] + [f"served_c{s}" for s in args.streams if s > 1]
    headline = {k: round(math.exp(statistics.fmean(math.log(r[k]["ratio"]) for r in rows)), 3) for k in keys}
    for r in rows:
        headline |= {f"{k}_{r['model']}": r[k]["ratio"] for k in keys}
    headline["greedy_agreement"] = min(r[f"offline_b{b}"]["greedy_agreement"] for r in rows for b in BATCHES)
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
