"""The Ray Serve application: one ingress deployment whose ASGI app is `api.create_app`.

The engines are named actors created by the launcher; the replica looks them up by name, so
the deployment carries only plain data (the config and the names) and a replica that Serve
restarts finds the same engines.
"""

from __future__ import annotations

from typing import Any

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
from engine.config import Config
from serve.engines import EngineSupervisor
from serve.placement import NORMAL_PRIORITY

DEPLOYMENT_NAME = "raypd-api"
_CONTROL_HEADROOM = 64  # requests beyond the admitted ones: health checks, metrics, refusals
# Serve counts a request as queued until the replica has taken it, and a burst arrives faster
# than its router hands requests over: with a queue of 256, a burst of 300 at an ingress
# admitting 100 had Serve refuse 18-30 of them itself, in plain text. The ingress refuses in
# OpenAI's shape; Serve's bound is the last resort, several times what the ingress admits.
_SERVE_QUEUE_PER_ADMITTED = 8


class Ingress:
    def __init__(self, config: dict[str, Any], engine_names: dict[str, list[str]], namespace: str) -> None:
        cfg = Config.from_dict(config)
        keep_off(cfg.worker_cpu_list)
        handles = {name: ray.get_actor(name, namespace=namespace) for names in engine_names.values() for name in names}
        by_name = {name: Engine.remote(name, handle) for name, handle in handles.items()}

        def engines(role: str) -> list[Engine]:
            return [by_name[name] for name in engine_names[role]]

        migration = MigrationPolicy(timeout_s=cfg.migration_timeout_s)
        router = make_router(cfg, engines("prefill"), engines("decode"), migration)
        supervisor = EngineSupervisor(cfg, handles, lambda name, handle: by_name[name].rebind(handle))
        self._app = create_app(cfg, router, background=supervisor.run)
        freeze_startup_objects()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


def build_app(cfg: Config, engine_names: dict[str, list[str]], namespace: str) -> Application:
    """`engine_names`: "prefill" and "decode" lists (no prefill names: colocated engines)."""
    # Serve queues requests beyond max_ongoing_requests in front of the replica: allow more than
    # the app admits (it answers 503 in OpenAI's shape past `inflight_limit`), with room for
    # /health and /metrics; Serve's own queue is bounded too, and past it Serve answers 503 with
    # Retry-After (a plain-text body).
    deployment = serve.deployment(
        serve.ingress()(Ingress),
        name=DEPLOYMENT_NAME,
        ray_actor_options={"num_cpus": 0, "runtime_env": NORMAL_PRIORITY},  # it routes, it does not compute
        max_ongoing_requests=cfg.inflight_limit + _CONTROL_HEADROOM,
        max_queued_requests=_SERVE_QUEUE_PER_ADMITTED * cfg.inflight_limit + _CONTROL_HEADROOM,
        backpressure_config=BackpressureConfig(retry_after_s=RETRY_AFTER_S),
    )
    return deployment.bind(cfg.to_dict(), engine_names, namespace)
