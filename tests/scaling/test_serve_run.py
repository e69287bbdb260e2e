"""`serve run` of raypd's Serve config file (serve/raypd.yaml, the application builder
`serve.app:build`), as Ray users deploy an application: it serves, with the ingress replicas
the file asks for, and Ctrl-C ends it with its local cluster; the builder's args on the
command line are checked, a bad one refused naming it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from actors.ports import free_port
from tests.scaling.conftest import MODEL_DIR, TIMEOUT_S, body

pytestmark = pytest.mark.scaling

ROOT = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).parent / "serve"
START_LIMIT_S = 300.0
# `serve run` learns of Ctrl-C through Python's default SIGINT handler, which Python does not
# install in a process started with SIGINT ignored, as everything under a background job of a
# non-interactive shell is (`make test-scaling &`): there the test's Ctrl-C did nothing, and the
# cluster outlived the test. The command is run through this, which puts the default back.
_SIGINT_RESTORED = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def _config(tmp_path: Path, port: int, **args: object) -> Path:
    config = yaml.safe_load((ROOT / "serve" / "raypd.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"] |= {"model": str(MODEL_DIR), "served_model_name": "tiny", "device": "cpu", "worker_threads": 1, **args}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def ray_tmp() -> Iterator[str]:
    """A temp dir of its own for `serve run`'s cluster, short enough for Ray's socket paths."""
    path = tempfile.mkdtemp(prefix="rpd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve_run(target: str, ray_tmp: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-c", _SIGINT_RESTORED, str(SERVE), "run", target, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_serve_run_of_the_config_file_serves_and_stops_on_ctrl_c(shipped_model, tmp_path, ray_tmp):
    port = free_port()
    proc = _serve_run(str(_config(tmp_path, port, num_kv_blocks=256, max_model_len=512)), ray_tmp)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S) as client:
            deadline = time.monotonic() + START_LIMIT_S
            while True:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "serve run did not come up"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            for _ in range(4):  # over both ingress replicas
                r = client.post("/v1/completions", json=body("ab=381;qe=027;?qe=", 8))
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


def test_serve_run_of_the_builder_with_a_bad_arg_names_it(shipped_model, ray_tmp):
    """The builder's args on the command line, as `serve run serve.app:build prefill=1 ...`."""
    proc = _serve_run("serve.app:build", ray_tmp, f"model={MODEL_DIR}", "device=cpu", "max_decode=many")
    out, _ = proc.communicate(timeout=START_LIMIT_S)
    assert proc.returncode != 0
    assert "invalid max_decode 'many': must be an integer (from the application's args)" in out, out[-3000:]
