"""Ray nodes started with `ray start --block`, as a user starts them, for the cluster tests.

Each node gets its own `--temp-dir` and its own ports, so its address file and ports do not
clash with other Ray clusters on the machine (a plain `ray start --head` would write
/tmp/ray/ray_current_cluster, which every `ray.init()` on the machine then joins). A node is
stopped with SIGTERM to its `ray start --block` process, which drains and stops the node's
processes; whatever is left that names the node's temp dir is killed by pid. `ray stop` is
never used: it stops every Ray process on the machine, other people's included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from actors.ports import free_ports

RAY = str(Path(sys.executable).with_name("ray"))
STOP_TIMEOUT_S = 40
REGISTER_TIMEOUT_S = 180


@dataclass
class RayNode:
    proc: subprocess.Popen[bytes]
    temp_dir: Path
    log: Path
    ports: dict[str, int]

    @property
    def gcs_port(self) -> int:
        return self.ports["port"]

    @property
    def dashboard_port(self) -> int:
        return self.ports["dashboard-port"]


_PORTS = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)
_WORKER_PORTS = _PORTS[3:]


def ray_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This venv's tools first on PATH (a job's `python` is the node's), token auth on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYPD_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_MODE"] = "token"
    env.update(extra or {})
    return env


def start_node(
    temp_dir: Path,
    *,
    head_address: str | None = None,
    num_cpus: int = 4,
    resources: Mapping[str, float] | None = None,
    node_ip: str | None = None,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    dashboard_host: str = "127.0.0.1",
) -> RayNode:
    """A head node (no `head_address`) or a worker node joining one. `prefix` runs the command
    through another (`ip netns exec NS`); `env` is added to the node's environment."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    names = _WORKER_PORTS if head_address else _PORTS
    ports = dict(zip(names, free_ports(len(names)), strict=False))
    cmd = [
        *prefix,
        RAY,
        "start",
        "--block",
        "--temp-dir",
        str(temp_dir),
        "--num-cpus",
        str(num_cpus),
        "--disable-usage-stats",
        *(f"--{k}={v}" for k, v in ports.items()),
    ]
    if head_address:
        cmd += ["--address", head_address]
    else:
        cmd += ["--head", "--dashboard-host", dashboard_host, "--include-dashboard", "true"]
    if resources:
        cmd += ["--resources", json.dumps(dict(resources))]
    if node_ip:
        cmd += ["--node-ip-address", node_ip]
    log = temp_dir / "ray-start.log"
    # A raylet on a busy 2-core machine can take longer than Ray's 30 s to register with the GCS.
    node_env = {"RAY_raylet_start_wait_time_s": str(REGISTER_TIMEOUT_S), **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=ray_env(node_env), start_new_session=True
        )
    return RayNode(proc, temp_dir, log, ports)


def wait_started(node: RayNode, timeout_s: float = REGISTER_TIMEOUT_S + 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in node.log.read_text():
        if node.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {node.proc.returncode}:\n{node.log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ray start not up after {timeout_s}s:\n{node.log.read_text()[-3000:]}")
        time.sleep(0.5)


def wait_dashboard(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # 401 is an answer too: with token auth on, the dashboard wants the token.
            if httpx.get(url + "/api/version", timeout=2).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no dashboard at {url} after {timeout_s}s")
        time.sleep(0.5)


def stop_node(node: RayNode) -> None:
    """SIGTERM the node's `ray start --block` (it drains and stops its processes), then kill by pid
    anything still naming the node's temp dir."""
    if node.proc.poll() is None:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
    kill_leftovers(str(node.temp_dir))


def kill_leftovers(marker: str) -> list[int]:
    """Kill (by pid) the processes whose command line contains `marker`: a node's temp dir."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed
