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
from ray.serve.deployment import Application

from actors.config import Config
from api import Engine, PDRouter, RoundRobinRouter, Router, create_app
from serve.engines import EngineSupervisor

DEPLOYMENT_NAME = "raypd-api"


class Ingress:
    def __init__(self, config: dict[str, Any], engine_names: dict[str, list[str]], namespace: str) -> None:
        cfg = Config.from_dict(config)
        handles = {name: ray.get_actor(name, namespace=namespace) for names in engine_names.values() for name in names}
        by_name = {name: Engine.remote(name, handle) for name, handle in handles.items()}

        def engines(role: str) -> list[Engine]:
            return [by_name[name] for name in engine_names[role]]

        router: Router = (
            PDRouter(engines("prefill"), engines("decode"))
            if engine_names["prefill"]
            else RoundRobinRouter(engines("decode"))
        )
        supervisor = EngineSupervisor(cfg, handles, lambda name, handle: by_name[name].rebind(handle))
        self._app = create_app(cfg, router, background=supervisor.run)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


def build_app(cfg: Config, engine_names: dict[str, list[str]], namespace: str) -> Application:
    """`engine_names`: "prefill" and "decode" lists (no prefill names: colocated engines)."""
    # Serve queues requests beyond max_ongoing_requests in front of the replica; allow what the
    # engines can hold so that their own bound (answered with 503) is the one clients meet.
    capacity = len(engine_names["decode"]) * (cfg.max_num_seqs + cfg.max_waiting) + 64
    deployment = serve.deployment(
        serve.ingress()(Ingress),
        name=DEPLOYMENT_NAME,
        ray_actor_options={"num_cpus": 0},  # it routes, it does not compute
        max_ongoing_requests=capacity,
    )
    return deployment.bind(cfg.to_dict(), engine_names, namespace)
