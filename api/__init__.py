"""The OpenAI-compatible HTTP API: `create_app(cfg, router)` builds the FastAPI app; a `Router`
(`RoundRobinRouter` over colocated `Engine`s, `PDRouter` over prefill and decode ones) decides which engine serves a request."""

from api.app import create_app
from api.router import ColocatedRouter, Engine, PDRouter, RoundRobinRouter, Router, make_router

__all__ = ["ColocatedRouter", "Engine", "PDRouter", "RoundRobinRouter", "Router", "create_app", "make_router"]
