"""`python -m serve` as a user runs it (what `make serve` runs): it comes up, answers, and
Ctrl-C (SIGINT) stops it cleanly with exit code 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from actors.ports import free_port
from bench.proc_tree import descendants, title
from serve.launch import QUIET_LOCAL_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "tiny-hybrid"
START_TIMEOUT_S = 150


def without_a_worker() -> dict[int, str]:
    """This machine's engine and API replica processes, by pid, each with whether it maps
    libtorch (only workers should: docs/design.md §14)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
            if title.startswith(("ray::EngineActor", "ray::ServeReplica:raypd")):
                found[int(proc.name)] = f"{title} torch={'libtorch' in (proc / 'maps').read_text()}"
        except OSError:
            continue  # the process ended meanwhile
    return found


def listener(port: int) -> int:
    """The pid of the process listening on `port` of 127.0.0.1 (from /proc/net/tcp and each
    process's open sockets)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # 127.0.0.1, LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue  # the process ended meanwhile, or is not ours to read
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def wait_until_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not up after {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


def run_server(tmp_path: Path, model: str, *flags: str):
    port = free_port()
    log = tmp_path / "serve.log"
    # Serve's settings too: this process's test clusters put raypd's into its environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYPD_", "RAY_SERVE_"))}
    env["RAYPD_MAX_MODEL_LEN"] = "256"  # one knob from the environment, the rest from flags
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve", "--model", model, "--port", str(port), *flags],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}", log


def stop_server(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while "raypd is serving" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)  # the app answers a moment before `serve.run` returns and the banner is printed
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_cli_starts_answers_and_stops_on_ctrl_c(tmp_path):
    """The shipped model with the defaults, as `make serve` runs it (flags are parsed and
    checked in tests/serve/test_config.py; a second start here with other flags took 27 s)."""
    proc, url, log = run_server(tmp_path, str(SHIPPED), "--worker-threads", "1")
    try:
        wait_until_up(proc, url, log)
        (card,) = httpx.get(url + "/v1/models").json()["data"]
        assert card["max_model_len"] == 256
        start = time.monotonic()
        r = httpx.post(
            url + "/v1/completions", json={"model": card["id"], "prompt": "t1 t2", "max_tokens": 4}, timeout=5
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
        assert time.monotonic() - start < 5
        chat = httpx.post(
            url + "/v1/chat/completions",
            timeout=5,
            json={"model": card["id"], "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 4},
        )
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
        processes = without_a_worker()
        assert any("EngineActor" in p for p in processes.values()), processes
        assert all(p.endswith("torch=False") for p in processes.values()), processes
        # Ray's dashboard stays off unless asked for (--ray-dashboard): its module processes
        # (ray-dashboard-ReportHead-0, ...) woke on timers on the forward's cores.
        below = {pid: title(pid) for pid in descendants(proc.pid)}
        assert any(t.startswith("ray::ProxyActor") for t in below.values()), below
        assert not [t for t in below.values() if t.startswith("ray-dashboard-")], below
        # Serve runs as in every cluster raypd starts (serve/launch.py, QUIET_LOCAL_CLUSTER),
        # its processes at normal priority too.
        (proxy,) = [pid for pid, t in below.items() if t.startswith("ray::ProxyActor")]
        environ = set(Path(f"/proc/{proxy}/environ").read_bytes().split(b"\0"))
        assert {f"{k}={v}".encode() for k, v in QUIET_LOCAL_CLUSTER.items()} <= environ
        assert os.getpriority(os.PRIO_PROCESS, proxy) == 0
        # The one API replica serves the port itself (Serve's direct ingress, launch.direct_ingress);
        # Serve's proxy, which it still starts, listens elsewhere and carries nothing.
        port = int(url.rsplit(":", 1)[1])
        replica = listener(port)
        assert title(replica).startswith("ray::ServeReplica:raypd"), title(replica)
        assert os.getpriority(os.PRIO_PROCESS, replica) == 0
        # A replica that dies is restarted by Serve on the same port, at once.
        os.kill(replica, signal.SIGKILL)
        wait_until_up(proc, url, log)
        restarted = listener(port)
        assert restarted != replica and title(restarted).startswith("ray::ServeReplica:raypd")
        r = httpx.post(
            url + "/v1/completions", json={"model": card["id"], "prompt": "t1 t2", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 200, r.text
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    stop_server(proc, log)
    text = log.read_text()
    assert f"at {url}/v1" in text and "api_key" in text  # the banner: URL and the whole config
