"""`python -m serve` refuses an address it cannot listen on before it starts a cluster, and a
start that fails in an actor is reported in one line, not Ray's remote traceback."""

from __future__ import annotations

import socket

import pytest
import ray
from ray.exceptions import RayTaskError

from actors.ports import free_port
from serve.__main__ import _reason, main


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for var in ("RAYPD_ADDRESS", "RAYPD_PORT", "RAYPD_HOST", "RAYPD_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def test_a_port_in_use_is_refused_before_ray_starts(capsys):
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"raypd: cannot listen on 127.0.0.1:{port} (--host, --port): Address already in use" in err
    assert err.count("\n") == 1
    assert not ray.is_initialized()


def test_a_host_not_on_this_machine_is_refused(capsys):
    assert main(["--host", "203.0.113.7", "--port", str(free_port())]) == 2
    assert "cannot listen on 203.0.113.7:" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_an_actors_error_is_reported_without_its_remote_traceback():
    cause = RuntimeError("Failed to bind to address '127.0.0.1:8000'.")
    wrapped = RayTaskError("ProxyActor.ready", "Traceback (most recent call last):\n  ...", cause)
    assert _reason(wrapped) == "Failed to bind to address '127.0.0.1:8000'."
    assert _reason(ValueError("plain")) == "plain"
