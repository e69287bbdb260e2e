"""The Ray actor around a `Worker`.

`execute_model` is async so the scheduler can keep one step in flight while it submits the
next (async scheduling). The step is queued on the worker's compute stream before the
method first awaits, so steps reach the stream in the order they start here. An async actor
may *start* calls out of order, though (one whose argument is still being fetched from the
object store can be overtaken: Ray's "Actor Task Execution Order"), so a step that arrives
ahead of its predecessor waits for it: the scheduler numbers steps consecutively and sends
every step to every worker.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import ray

from actors.process import freeze_startup_objects
from actors.step_channel import StepServer
from engine.messages import ModelRunnerOutput, SchedulerOutput
from kv.cache_layout import CacheLayout
from kv.nixl.peers import PeerInfo
from kv.nixl.transfer_stats import TransferStats
from worker.config import WorkerConfig

if TYPE_CHECKING:
    from worker.worker import Worker

# Room for two steps (one running, one queued behind it) plus control calls and a step that
# arrived early and waits for its predecessor.
MAX_CONCURRENCY = 4


class WorkerActor:
    def __init__(self, cfg: WorkerConfig, *, num_threads: int | None = None, step_wait_s: float = 60.0) -> None:
        """`num_threads` caps torch's threads in this process, so two workers on one machine do
        not fight over the same cores. Steps are numbered from 0; one that waits longer than
        `step_wait_s` for its predecessor fails."""
        # Imported here, in the worker's own process: the engine that creates this actor
        # imports this module for the class alone and must not load torch (docs/design.md §14).
        import torch

        from worker.worker import Worker

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._worker: Worker = Worker(cfg)
        freeze_startup_objects()
        self._next_step = 0
        self._step_wait_s = step_wait_s
        self._turn = asyncio.Condition()
        self._steps = StepServer(self._worker.execute_model, self._worker.with_finished_transfers)

    def ready(self) -> bool:
        return True

    def layout(self) -> CacheLayout:
        return self._worker.layout

    async def open_step_channel(self, engine_pid: int) -> tuple[str, str, int]:
        """This worker's node, the address of its step channel (actors/step_channel.py) and the
        pid listening there: an engine on the same node, process `engine_pid`, sends its steps
        there instead of calling `execute_model`."""
        address = await self._steps.listen(engine_pid)
        return ray.get_runtime_context().get_node_id(), address, os.getpid()

    async def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.step_id < self._next_step:
            raise ValueError(f"step {out.step_id} arrived after step {self._next_step - 1} already ran")
        if out.step_id > self._next_step:
            async with self._turn:
                try:
                    await asyncio.wait_for(
                        self._turn.wait_for(lambda: self._next_step == out.step_id), self._step_wait_s
                    )
                except TimeoutError:
                    raise TimeoutError(
                        f"step {out.step_id} waited {self._step_wait_s}s for step "
                        f"{self._next_step}, which never arrived"
                    ) from None
        future = self._worker.execute_model(out)
        self._next_step = out.step_id + 1
        async with self._turn:
            self._turn.notify_all()
        return self._worker.with_finished_transfers(await asyncio.wrap_future(future))

    def nixl_peer(self) -> PeerInfo:
        """What a decode worker needs to READ from this one (exchanged through Ray)."""
        if self._worker.connector is None:
            raise RuntimeError("a colocated worker has no NIXL agent")
        return self._worker.connector.metadata()

    def add_nixl_peer(self, info: PeerInfo) -> None:
        if self._worker.connector is None:
            raise RuntimeError("a colocated worker has no NIXL agent")
        self._worker.connector.add_peer(info)

    def remove_nixl_peers(self, engine_id: str) -> list[str]:
        if self._worker.connector is None:
            raise RuntimeError("a colocated worker has no NIXL agent")
        return self._worker.connector.remove_peers(engine_id)

    def nixl_peer_names(self) -> list[str]:
        return [] if self._worker.connector is None else self._worker.connector.peer_names

    def transfer_stats(self) -> TransferStats | None:
        return self._worker.transfer_stats()

    def held(self) -> dict[str, int]:
        """What this rank still holds for requests (each zero once its engine is idle): the
        request states the scheduler has not yet told it to forget, and its connector's
        loads, unreported loads and partly counted notifications."""
        held = {"requests": len(self._worker.requests)}
        if self._worker.connector is not None:
            held.update(self._worker.connector.held())
        return held

    def inject_faults(self, num_steps: int) -> None:
        self._worker.inject_faults(num_steps)

    def shutdown(self) -> None:
        self._steps.close()
        self._worker.close()


# num_cpus=0: a worker's cores are governed by `num_threads`, not by Ray's CPU accounting,
# which runs out fast on a 2-core CI machine. Callers that want Ray to place
# workers by CPU or GPU pass `.options(num_cpus=..., num_gpus=...)`.
RemoteWorker = ray.remote(num_cpus=0, max_concurrency=MAX_CONCURRENCY)(WorkerActor)
