"""Bringing a deployment up and down: the Ray cluster, the engine actors, the Serve application.

`start` undoes what it did if it fails part-way, and `stop` takes down only what `start`
created: an existing cluster (`--address`) keeps running, and so do other Serve apps on it.
The engines belong to the engine controller (serve/controller.py), which `start` creates and
`stop` stops with them.

Detached (`--detach`, on an existing cluster, e.g. from `ray job submit`): the controller and
the engines are detached named actors anyway and the Serve app lives in Serve's own detached
controller, so `leave` only disconnects and the service outlives the driver; `stop_detached`
(`python -m serve --stop`) finds them by name later and takes them down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from actors.ports import free_port
from engine.config import Config
from serve.app import build_app
from serve.controller import CONTROLLER_NAME, RemoteController, controller_options, stop_controller
from serve.engines import NAMESPACE, stop_engines

APP_NAME = "raypd"


@dataclass
class Deployment:
    cfg: Config
    started_cluster: bool = False  # a local cluster this process started (and stops)
    connected: bool = False  # this process called ray.init (and disconnects)
    engines: dict[str, Any] = field(default_factory=dict)  # the engines started: name -> EngineActor handle
    controller: Any = None  # the engine controller this process created (and stops)
    serving: bool = False
    direct_ingress: bool = False  # the API replica serves HTTP itself (`direct_ingress`)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"


QUIET_LOCAL_CLUSTER = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_worker_niceness": "0",
}
"""Settings of a cluster raypd starts itself (docs/design.md §14), each overridden by the same
variable in the environment. Serve's controller reconciles every 0.1 s by default; an idle
service's controller then took 2.6% of a core, on the cores the forward computes on. Every
1 s it takes 0.9%, and a served Qwen3-0.6B-sized token on 2 cores went from 146 to 142 ms.
raypd's own controller watches the engines; Serve's only restarts API replicas and routes to
them, a second later at most. The proxy and each replica flush Serve's request metrics every
0.1 s by default, ~0.4% of a core each while idle; every second, Serve's metrics lag by a
second more.

The next four are Ray's `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode less its direct ingress (which
`direct_ingress` turns on where it can): the proxy streams to the replicas over gRPC, the
app's code and Serve's router run on the replica's own event loop, not a thread and a loop of
their own, and request-path log lines are written 1000 at a time (an ERROR line at once). Each
streamed token costs the proxy about a third less CPU and the replica a fifth less, taken from
the forward's cores on a laptop (BENCHMARKS.md, `bench.peers_real`).

Every process Ray starts runs at normal priority, Serve's too: at Ray's default nice 15 the
proxy, which every request and every streamed token passes through, got a sliver of a core
beside a forward computing on all of them, and 32 requests sent at once reached the engine
over 2-4 s instead of together (serve/placement.py says the same of raypd's own actors)."""


def direct_ingress(cfg: Config) -> dict[str, str]:
    """Serve's direct ingress for the one API replica of a cluster raypd starts: the replica
    serves HTTP itself on `--port` and Serve's proxy carries nothing, so a request and each
    token it streams cross one process fewer (docs/design.md §14). Serve gives each ingress replica a
    port of its own from a range, and without a load balancer in front (HAProxy) only one
    replica can own `--port`; with `--api-replicas` above 1 Serve's proxy stays and spreads
    requests over them. A replica Serve restarts takes the port again at once (no quarantine:
    no balancer still routes to the old one), and stopping drains no balancer either."""
    if cfg.api_replicas != 1:
        return {}
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(cfg.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(cfg.port + 1),  # the range ends before it
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def quiet_local_cluster() -> None:
    """Put `QUIET_LOCAL_CLUSTER` into this process's environment, where the processes of a
    cluster it starts next with ray.init read it; a variable already set is left as it is."""
    for name, value in QUIET_LOCAL_CLUSTER.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def environ_for_cluster(values: dict[str, str]) -> Iterator[bool]:
    """`values` in this process's environment while a local cluster starts (its processes copy
    the environment then), and the environment as it was afterwards, so a later cluster of this
    process (a test's, another port) does not inherit them. Yields whether they were applied:
    as a group, and not where the environment already sets any of them (the user chose)."""
    if not values or any(name in os.environ for name in values):
        yield False
        return
    os.environ.update(values)
    try:
        yield True
    finally:
        for name in values:
            del os.environ[name]


def start(cfg: Config, **ray_init: Any) -> Deployment:
    """Connect to Ray (or start a local cluster), create and wait for the engines, deploy the API.
    `ray_init` adds options to a ray.init of a local cluster (tests turn the dashboard off)."""
    dep = Deployment(cfg)
    try:
        if not ray.is_initialized():
            if cfg.detach and cluster_address(cfg) is None:
                raise ValueError(
                    "--detach needs a running cluster to stay on: give --address (or RAY_ADDRESS, which a Ray job sets)"
                )
            if cluster_address(cfg) is None:
                quiet_local_cluster()
                # Control-plane actors take no CPU; a generous logical count keeps the rest placeable
                # on a small machine (Ray's CPU accounting runs out fast on 2 cores).
                with environ_for_cluster(direct_ingress(cfg)) as dep.direct_ingress, keeping_sigterm():
                    ray.init(
                        address="local",
                        namespace=NAMESPACE,
                        num_cpus=max(8, os.cpu_count() or 1),
                        logging_level=logging.getLevelNamesMapping()[cfg.log_level],
                        **({"include_dashboard": cfg.ray_dashboard} | ray_init),
                    )
                dep.started_cluster = True
            else:
                _join(cfg)
            dep.connected = True
        dep.controller = RemoteController.options(**controller_options(get_if_exists=False)).remote(cfg.to_dict())
        engines = ray.get(dep.controller.start.remote())
        dep.engines.update(engines.prefill)
        dep.engines.update(engines.decode)
        # With direct ingress Serve still starts a proxy on the head node, which would take the
        # port from the replica: it gets one of its own, and nothing is sent to it.
        proxy_port = free_port() if dep.direct_ingress else cfg.port
        serve.start(http_options={"host": cfg.host, "port": proxy_port}, logging_config={"log_level": cfg.log_level})
        dep.serving = True
        serve.run(build_app(cfg, NAMESPACE), name=APP_NAME, route_prefix="/")
    except BaseException:
        stop(dep)
        raise
    return dep


@contextlib.contextmanager
def keeping_sigterm() -> Iterator[None]:
    """Put the caller's Python SIGTERM handler back once the body (a `ray.init`) is done.

    ray.init installs Ray's own handler in C, which prints a stack trace and aborts the
    process: a `kill` (or `docker stop`) during the rest of a start, which loads a model and
    can take minutes, killed `python -m serve` with SIGABRT and left the local cluster's
    processes running, where the caller's handler stops the service as Ctrl-C does."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def cluster_address(cfg: Config) -> str | None:
    """The cluster to join: `--address`, else RAY_ADDRESS (set for a `ray job submit` entrypoint),
    else None: start a local one."""
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


def _join(cfg: Config) -> None:
    try:
        with keeping_sigterm():
            ray.init(
                address=cluster_address(cfg),
                namespace=NAMESPACE,
                logging_level=logging.getLevelNamesMapping()[cfg.log_level],
            )
    except ConnectionError as e:
        # Ray enables token auth only for clusters it finds itself, never for an explicit address.
        if os.environ.get("RAY_AUTH_MODE") is None:
            raise ConnectionError(
                f"{e} (if the cluster uses token authentication, as `ray start` does by "
                "default, set RAY_AUTH_MODE=token)"
            ) from e
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
        if dep.controller is not None:
            stop_controller()  # the engines it owns, scaled ones too
            dep.controller = None
        stop_engines(list(dep.engines))  # by name, should any have outlived the controller
        dep.engines.clear()
        if dep.connected:
            ray.shutdown()


def leave(dep: Deployment) -> None:
    """Disconnect, leaving a detached deployment running on its cluster."""
    if dep.connected:
        ray.shutdown()


def stop_detached(cfg: Config) -> list[str]:
    """Take down a detached deployment on the cluster `cfg` names: the Serve app and every engine
    actor in raypd's namespace. Returns the engines stopped (none: nothing was running)."""
    _join(cfg)
    try:
        with contextlib.suppress(RayServeException):  # no Serve on the cluster: no app to delete
            serve.delete(APP_NAME)
        stopped = stop_controller()  # first: it would replace the engines stopped below
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith("raypd-") and a["name"] != CONTROLLER_NAME
        )
        stop_engines(names)
        return sorted({*stopped, *names})
    finally:
        ray.shutdown()
