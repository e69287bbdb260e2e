"""An engine and its one worker in this process: the same classes as the Ray deployment,
for tests, benchmarks and the in-process HTTP app."""

from __future__ import annotations

import asyncio

from engine.build import make_engine, worker_config
from engine.config import Config
from engine.core import EngineCore
from worker.worker import Worker


def build_local_engine(cfg: Config) -> tuple[EngineCore, Worker]:
    """Scheduler and one worker in this process: the same classes as the Ray deployment."""
    worker = Worker(worker_config(cfg))

    def run(out):  # type: ignore[no-untyped-def]
        return asyncio.wrap_future(worker.execute_model(out))

    return make_engine(cfg, worker.layout, [run]), worker
