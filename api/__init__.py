"""The OpenAI-compatible HTTP API: `create_app(cfg, router)` builds the FastAPI app; a `Router`
(`RoundRobinRouter` over colocated `Engine`s for now) decides which engine serves a request."""

from api.app import create_app
from api.router import Engine, RoundRobinRouter, Router

__all__ = ["Engine", "RoundRobinRouter", "Router", "create_app"]
