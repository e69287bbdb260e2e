"""Deploying with `ray job submit`, as docs/deploying.md tells users: a cluster started with
`ray start --head` (token auth on), a first job that starts the service detached and exits,
a second job that load-tests it; both jobs succeed, and `python -m serve --stop` takes it down."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.cluster.ray_nodes import (
    RAY,
    free_ports,
    kill_leftovers,
    ray_env,
    start_node,
    stop_node,
    wait_dashboard,
    wait_started,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 420


def submit(dashboard: str, *entrypoint: str) -> str:
    """`ray job submit` (waits for the job); returns the job's final status and fails with its logs."""
    job_id = f"raypd-{uuid.uuid4().hex[:8]}"
    cmd = [
        RAY,
        "job",
        "submit",
        "--address",
        dashboard,
        "--submission-id",
        job_id,
        "--working-dir",
        ".",
        "--",
        *entrypoint,
    ]
    deadline = time.monotonic() + 60
    while True:  # the head's job agent registers a few seconds after the dashboard answers
        run = subprocess.run(cmd, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        if "No available agent" not in run.stdout + run.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    status = subprocess.run(
        [RAY, "job", "status", "--address", dashboard, job_id],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    why = f"job {job_id}: {status.stdout}\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert "succeeded" in status.stdout.lower(), why
    return run.stdout


def test_serve_and_load_test_as_ray_jobs():
    temp = Path(tempfile.mkdtemp(prefix="rpdj", dir="/tmp"))  # short: Ray's socket paths are length-limited
    (port,) = free_ports(1)
    out = temp / "load"
    head = None
    try:
        head = start_node(temp / "head", num_cpus=4)
        wait_started(head)
        dashboard = f"http://127.0.0.1:{head.dashboard_port}"
        wait_dashboard(dashboard)
        submit(
            dashboard,
            "python",
            "-m",
            "serve",
            "--detach",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            str(port),
            "--worker-threads",
            "1",
            "--log-level",
            "WARNING",
        )
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # up after its driver exited
        submit(
            dashboard,
            "python",
            "-m",
            "bench.load",
            "--url",
            url,
            "--requests",
            "40",
            "--concurrency",
            "8",
            "--max-tokens",
            "8",
            "--out",
            str(out),
        )
        report = json.loads(out.with_suffix(".json").read_text())["runs"][0]
        assert report["completed"] == 40 and report["failed"] == 0
        decode = report["server"]["raypd-decode-0"]
        assert decode["kv_transfer_loads"] == 40 and decode["kv_transfer_failed"] == 0
        assert out.with_suffix(".png").stat().st_size > 0
        stop = subprocess.run(
            [sys.executable, "-m", "serve", "--address", f"127.0.0.1:{head.gcs_port}", "--stop"],
            cwd=ROOT,
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stop.returncode == 0 and "raypd-prefill-0" in stop.stdout, stop.stdout + stop.stderr
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 404  # Serve's proxy stays, the app is gone
    finally:
        if head is not None:
            stop_node(head)
        kill_leftovers(str(temp))
        shutil.rmtree(temp, ignore_errors=True)
