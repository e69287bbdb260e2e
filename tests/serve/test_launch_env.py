"""What a cluster raypd starts itself is given through the environment (serve/launch.py): Serve's
direct ingress only where one API replica can own the port, and nothing left behind for the
next cluster the same process starts."""

from __future__ import annotations

import os

import pytest

from engine.config import Config
from serve.launch import direct_ingress, environ_for_cluster


def test_one_replica_serves_the_port_itself():
    settings = direct_ingress(Config(model="m", port=8123))
    assert settings["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve's range ends before its upper bound: exactly the port.
    low, high = (
        int(settings["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
        int(settings["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]),
    )
    assert list(range(low, high)) == [8123]
    assert settings["RAY_SERVE_PORT_QUARANTINE_S"] == "0"


def test_several_replicas_keep_serves_proxy():
    assert direct_ingress(Config(model="m", api_replicas=2)) == {}


@pytest.fixture
def clean_environ(monkeypatch):
    for name in direct_ingress(Config(model="m")):
        monkeypatch.delenv(name, raising=False)


def test_settings_last_only_while_the_cluster_starts(clean_environ):
    settings = direct_ingress(Config(model="m", port=8123))
    with environ_for_cluster(settings) as applied:
        assert applied
        assert all(os.environ[k] == v for k, v in settings.items())
    assert not any(k in os.environ for k in settings)


def test_a_setting_the_user_made_keeps_the_whole_group_out(clean_environ, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    settings = direct_ingress(Config(model="m", port=8123))
    with environ_for_cluster(settings) as applied:
        assert not applied
        assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
        assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in os.environ
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"


def test_no_settings_apply_nothing(clean_environ):
    with environ_for_cluster({}) as applied:
        assert not applied
