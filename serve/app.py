"""The Ray Serve application: one ingress deployment (`--api-replicas` replicas) whose ASGI app is
`api.create_app`, and its application builder for `serve run` / `serve deploy`.

The engines belong to the engine controller, a detached named actor (serve/controller.py); a
replica finds it by name, takes the current engine set from it and follows every change
(serve/watch.py). So the deployment carries only plain data (the config), any number of
replicas route to the same engines, and a replica that dies or that Serve restarts owns nothing
that dies with it.

    serve run serve.app:build model=models/tiny-hybrid prefill=1 decode=1    # args: Config fields
    serve deploy serve/raypd.yaml                                           # import_path: serve.app:build
"""

from __future__ import annotations

from typing import Any, cast

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.deployment import Application

from actors.process import freeze_startup_objects, keep_off
from api import Engine, create_app
from api.errors import RETRY_AFTER_S
from api.migration import MigrationPolicy
from api.router import make_router
from engine.build import check_tp
from engine.config import Config, ConfigError
from models.model_files import ModelLoadError, load_config
from serve.config import config_from_args
from serve.controller import CONTROLLER_NAME, EngineSet, RemoteController, controller_options
from serve.engines import NAMESPACE
from serve.placement import NORMAL_PRIORITY
from serve.watch import EngineSetWatcher

DEPLOYMENT_NAME = "raypd-api"
_CONTROL_HEADROOM = 64  # requests beyond the admitted ones: health checks, metrics, refusals
# Serve counts a request as queued until the replica has taken it, and a burst arrives faster
# than its router hands requests over: with a queue of 256, a burst of 300 at an ingress
# admitting 100 had Serve refuse 18-30 of them itself, in plain text. The ingress refuses in
# OpenAI's shape; Serve's bound is the last resort, several times what the ingress admits.
_SERVE_QUEUE_PER_ADMITTED = 8


class Ingress:
    def __init__(self, config: dict[str, Any], namespace: str) -> None:
        cfg = Config.from_dict(config)
        keep_off(cfg.bound_cpus)
        controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
        # The first replica's call starts the engines (a builder deployed by `serve run` only
        # created the controller); the others wait for them and get the same set.
        engines = cast(EngineSet, ray.get(controller.start.remote()))
        migration = MigrationPolicy(timeout_s=cfg.migration_timeout_s)
        router = make_router(
            cfg,
            [Engine.remote(n, h) for n, h in engines.prefill.items()],
            [Engine.remote(n, h) for n, h in engines.decode.items()],
            migration,
        )
        watcher = EngineSetWatcher(controller, router, engines, cfg.colocated)
        self._app: FastAPI = create_app(cfg, router, background=watcher.run)
        freeze_startup_objects()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


def build_app(cfg: Config, namespace: str = NAMESPACE) -> Application:
    """The ingress deployment, bound to `cfg`; the engine controller must exist in `namespace`."""
    # Serve queues requests beyond max_ongoing_requests in front of the replica: allow more than
    # the app admits (it answers 503 in OpenAI's shape past `inflight_limit`), with room for
    # /health and /metrics; Serve's own queue is bounded too, and past it Serve answers 503 with
    # Retry-After (a plain-text body).
    deployment = serve.deployment(
        serve.ingress()(Ingress),
        name=DEPLOYMENT_NAME,
        num_replicas=cfg.api_replicas,
        ray_actor_options={"num_cpus": 0, "runtime_env": NORMAL_PRIORITY},  # it routes, it does not compute
        max_ongoing_requests=cfg.inflight_limit + _CONTROL_HEADROOM,
        max_queued_requests=_SERVE_QUEUE_PER_ADMITTED * cfg.inflight_limit + _CONTROL_HEADROOM,
        backpressure_config=BackpressureConfig(retry_after_s=RETRY_AFTER_S),
    )
    return deployment.bind(cfg.to_dict(), namespace)


def build(args: dict[str, Any]) -> Application:
    """The application builder Serve calls (`serve run serve.app:build KEY=VALUE ...`, or a Serve
    config file's `import_path` and `args`): `args` are Config fields, as in a YAML config file.
    It checks them and the model, and creates the engine controller (or finds the one already
    running); the engines start with the first replica. A bad value is a ConfigError naming it."""
    cfg = config_from_args(args)
    try:
        load_config(cfg.model)
    except ModelLoadError as e:
        raise ConfigError(f"cannot serve {cfg.model}: {e} (`make model` builds the shipped model)", "model") from None
    for role in ("colocated",) if cfg.colocated else ("prefill", "decode"):
        check_tp(cfg, role)
    RemoteController.options(**controller_options()).remote(cfg.to_dict())
    return build_app(cfg)
