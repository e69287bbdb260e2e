"""Bringing a deployment up and down: the Ray cluster, the engine actors, the Serve application.

`start` undoes what it did if it fails part-way, and `stop` takes down only what `start`
created: an existing cluster (`--address`) keeps running, and so do other Serve apps on it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from actors.scheduler_actor import RemoteScheduler
from serve.app import build_app
from serve.config import Config

NAMESPACE = "raypd"
APP_NAME = "raypd"
ENGINE_SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class Deployment:
    cfg: Config
    started_cluster: bool = False  # a local cluster this process started (and stops)
    connected: bool = False  # this process called ray.init (and disconnects)
    engines: dict[str, Any] = field(default_factory=dict)  # name -> SchedulerActor handle
    serving: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"


def engine_names(cfg: Config) -> dict[str, list[str]]:
    """Actor names by role; colocated engines stand in the "decode" list."""
    if cfg.colocated:
        return {"prefill": [], "decode": [f"raypd-engine-{i}" for i in range(cfg.decode)]}
    return {"prefill": [f"raypd-prefill-{i}" for i in range(cfg.prefill)],
            "decode": [f"raypd-decode-{i}" for i in range(cfg.decode)]}


def start(cfg: Config, **ray_init: Any) -> Deployment:
    """Connect to Ray (or start a local cluster), create and wait for the engines, deploy the API.
    `ray_init` adds options to a ray.init of a local cluster (tests turn the dashboard off)."""
    dep = Deployment(cfg)
    try:
        if not ray.is_initialized():
            if cfg.address is None:
                # Control-plane actors take no CPU; a generous logical count keeps the rest placeable
                # on a small machine (DESIGN.md §4).
                ray.init(address="local", namespace=NAMESPACE, num_cpus=max(8, os.cpu_count() or 1),
                         logging_level=cfg.log_level, **ray_init)
                dep.started_cluster = True
            else:
                _join(cfg)
            dep.connected = True
        names = start_engines(cfg, dep.engines)
        serve.start(http_options={"host": cfg.host, "port": cfg.port}, logging_config={"log_level": cfg.log_level})
        dep.serving = True
        serve.run(build_app(cfg, names, NAMESPACE), name=APP_NAME, route_prefix="/")
    except BaseException:
        stop(dep)
        raise
    return dep


def start_engines(cfg: Config, engines: dict[str, Any]) -> dict[str, list[str]]:
    """Create the named engine actors into `engines` (so a caller can clean up after a failure
    part-way), wait until they are ready, and give every decode engine every prefill worker's
    NIXL agent (metadata through Ray). Returns the names by role."""
    names = engine_names(cfg)
    for role, role_names in names.items():
        for name in role_names:
            kind = role if not cfg.colocated else "colocated"
            engines[name] = RemoteScheduler.options(name=name, namespace=NAMESPACE).remote(cfg.to_dict(), kind, name)
    ray.get([h.ready.remote() for h in engines.values()])
    if names["prefill"]:
        peers = [p for ps in ray.get([engines[n].nixl_peers.remote() for n in names["prefill"]]) for p in ps]
        ray.get([engines[n].add_nixl_peers.remote(peers) for n in names["decode"]])
    return names


def _join(cfg: Config) -> None:
    try:
        ray.init(address=cfg.address, namespace=NAMESPACE, logging_level=cfg.log_level)
    except ConnectionError as e:
        # Ray enables token auth only for clusters it finds itself, never for an explicit address.
        if os.environ.get("RAY_AUTH_MODE") is None:
            raise ConnectionError(f"{e} (if the cluster uses token authentication, as `ray start` does by "
                                  "default, set RAY_AUTH_MODE=token)") from e
        raise


def stop(dep: Deployment) -> None:
    """Delete the app (all of Serve on a cluster we started), shut the engines down, disconnect."""
    try:
        if dep.serving:
            if dep.started_cluster:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
    finally:
        for handle in dep.engines.values():
            with contextlib.suppress(Exception):  # an engine that is already gone needs no shutdown
                ray.get(handle.shutdown.remote(), timeout=ENGINE_SHUTDOWN_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(handle)
        dep.engines.clear()
        if dep.connected:
            ray.shutdown()
