"""The engine as a Ray actor: the scheduler loop (`EngineCore`) driving its worker actors.

Its methods are what an `EngineClient` calls over Ray: add a request, abort one, and
collect outputs in batches (one round trip per step for all requests, not one per token).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.lease import LeaseRenewer
from actors.output_channel import OutputServer
from actors.output_mux import OutputMux
from actors.ports import free_port
from actors.process import freeze_startup_objects, keep_off
from actors.step_channel import StepChannel
from actors.worker_actor import RemoteWorker
from engine.build import Role, check_tp, disagg_config, make_engine, worker_config
from engine.config import Config
from engine.messages import EngineStats, OutputBatch, SamplingParams
from engine.summary import EngineSummary
from kv.nixl.peers import PeerInfo
from kv.nixl.transfer_params import KVTransferParams

# Heartbeats per lease: a renewal may be lost or late three times before the lease runs out.
_BEATS_PER_LEASE = 4


class EngineActor:
    def __init__(
        self,
        config: dict[str, Any],
        role: Role = "colocated",
        engine_id: str = "engine-0",
        worker_options: dict[str, Any] | None = None,
    ) -> None:
        """`worker_options` are the worker actor's `.options(...)` (serve/placement.py). The worker
        prefers this actor's node, since they talk every step; Ray places it elsewhere if this node
        lacks what it asks for (a GPU)."""
        self.config = Config.from_dict(config)
        keep_off(self.config.bound_cpus)
        self.role = role
        self.engine_id = engine_id
        # Unique per incarnation: a replaced engine's agent must not be confused with the old one.
        agent_name = f"{engine_id}-{uuid.uuid4().hex[:12]}" if role != "colocated" else ""
        check_tp(self.config, role)
        tp = self.config.tp_size(role)
        # The ranks meet at a port of this node, where they are placed too (a rank that Ray
        # must place elsewhere reaches it over the network).
        init = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}" if tp > 1 else ""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.workers = [
            RemoteWorker.options(scheduling_strategy=here, **(worker_options or {})).remote(
                worker_config(self.config, role, engine_id, agent_name, rank, init),
                num_threads=self.config.worker_threads,
            )
            for rank in range(tp)
        ]
        layouts = ray.get([w.layout.remote() for w in self.workers])
        if any((lay.num_blocks, lay.block_size) != (layouts[0].num_blocks, layouts[0].block_size) for lay in layouts):
            raise RuntimeError(f"the ranks of {engine_id} planned different caches: {layouts}")
        disagg = disagg_config(self.config, role, engine_id, agent_name)
        self._channels = _step_channels(self.workers)
        executors = [ch or w.execute_model.remote for ch, w in zip(self._channels, self.workers, strict=True)]
        self.core = make_engine(self.config, layouts[0], executors, disagg)
        # One queue and one output channel per client (API replica): actors/output_mux.py.
        self._mux = OutputMux(lambda: self.core.get_outputs(None), self.core.abort)
        self._outputs: dict[str, OutputServer] = {}
        self._lease_peers: dict[str, Any] = {}  # decode side: prefill engine id -> its actor handle
        self._renewer: asyncio.Task[None] | None = None
        freeze_startup_objects()

    async def ready(self) -> bool:
        return True

    async def nixl_peers(self) -> list[PeerInfo]:
        """This engine's workers as NIXL peers, for the decode engines to read from."""
        return list(await asyncio.gather(*(w.nixl_peer.remote() for w in self.workers)))

    async def add_nixl_peers(self, peers: list[PeerInfo]) -> None:
        await asyncio.gather(*(w.add_nixl_peer.remote(p) for w in self.workers for p in peers))

    async def forget_nixl_engine(self, engine_id: str) -> list[str]:
        """Drop every NIXL agent of a prefill engine that died (serve/engines.py calls it before
        wiring the replacement): its loads in flight fail, and its agents are never read again."""
        removed = await asyncio.gather(*(w.remove_nixl_peers.remote(engine_id) for w in self.workers))
        return [name for names in removed for name in names]

    async def nixl_peer_names(self) -> list[str]:
        """The NIXL agents this engine's workers can read from."""
        names = await asyncio.gather(*(w.nixl_peer_names.remote() for w in self.workers))
        return sorted({n for ns in names for n in ns})

    async def set_lease_peers(self, engines: dict[str, Any]) -> None:
        """Decode side: the prefill engines (id -> actor handle) whose leases this engine renews
        while its requests wait for their KV (actors/lease.py). A replaced engine's new handle
        replaces the old one under the same id."""
        self._lease_peers.update(engines)
        if self._renewer is None:
            lease = self.config.kv_lease_s
            renewer = LeaseRenewer(
                self.core.scheduler.disaggregation(), self._renew_at, lease / _BEATS_PER_LEASE, timeout_s=lease
            )
            self._renewer = asyncio.get_running_loop().create_task(renewer.run())

    async def _renew_at(self, engine_id: str, req_ids: list[str]) -> dict[str, float]:
        return await self._lease_peers[engine_id].renew_leases.remote(req_ids)

    async def renew_leases(self, req_ids: list[str]) -> dict[str, float]:
        """Prefill side: a decode engine's heartbeat; the new deadline of each lease still held."""
        return self.core.scheduler.disaggregation().renew_leases(req_ids)

    async def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        do_remote_decode: bool = False,
        client_id: str = "",
    ) -> None:
        """`client_id`: the client (API replica) whose `get_outputs` gets this request's outputs."""
        self._mux.own(req_id, client_id)
        try:
            self.core.add_request(req_id, prompt_token_ids, sampling, kv_transfer_params, do_remote_decode)
        except BaseException:
            self._mux.disown(req_id)
            raise

    async def abort(self, req_id: str) -> None:
        self.core.abort(req_id)

    async def get_outputs(self, timeout: float, client_id: str = "") -> list[OutputBatch]:
        return await self._mux.get(client_id, timeout)

    async def open_output_channel(self, client_pid: int, client_id: str = "") -> tuple[str, str, int]:
        """This engine's node, the address it pushes `client_id`'s outputs to and its pid: a
        client on the same node, process `client_pid`, reads them there instead of calling
        `get_outputs` (actors/output_channel.py)."""
        server = self._outputs.get(client_id)
        if server is None:
            server = self._outputs[client_id] = OutputServer(lambda: self._mux.get(client_id, None))
        address = await server.open_for(client_pid)
        return ray.get_runtime_context().get_node_id(), address, os.getpid()

    async def inject_worker_faults(self, num_steps: int) -> None:
        """Tests only (over Ray, never HTTP): the workers' next `num_steps` forwards fail."""
        await asyncio.gather(*(w.inject_faults.remote(num_steps) for w in self.workers))

    async def stats(self) -> EngineStats:
        """The engine's stats with its workers' KV-transfer counters (`extra["kv_transfer"]`) and
        what each rank still holds (`extra["ranks_held"]`, rank order)."""
        stats = self.core.stats()
        transfers = await asyncio.gather(*(w.transfer_stats.remote() for w in self.workers))
        stats.extra["kv_transfer"] = [t for t in transfers if t is not None]
        stats.extra["ranks_held"] = await asyncio.gather(*(w.held.remote() for w in self.workers))
        return stats

    def routing_summary(self, since_version: int | None = None) -> EngineSummary:
        """The engine's load and cache digest for the routers (engine/summary.py): no worker
        is asked, so the routers' periodic polls stay cheap."""
        return self.core.routing_summary(since_version)

    async def wait_idle(self) -> EngineStats:
        await self.core.wait_idle()
        self.core.scheduler.kv.check_integrity()
        return self.core.stats()

    async def shutdown(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        await asyncio.gather(*(server.close() for server in self._outputs.values()))
        await self._mux.close()
        await self.core.close()
        await asyncio.gather(*(ch.close() for ch in self._channels if ch is not None))
        await asyncio.gather(*(w.shutdown.remote() for w in self.workers))


def _step_channels(workers: list[Any]) -> list[StepChannel | None]:
    """A step channel to each worker on this node; None for one Ray placed elsewhere, which is
    sent its steps by actor calls (actors/step_channel.py)."""
    here = ray.get_runtime_context().get_node_id()
    opened = ray.get([w.open_step_channel.remote(os.getpid()) for w in workers])
    return [StepChannel(address, pid) if node == here else None for node, address, pid in opened]


# Control-plane actor: it schedules, it does not compute, so it takes no CPU slot: Ray's CPU
# accounting runs out fast on a 2-core machine.
RemoteEngine = ray.remote(num_cpus=0, max_concurrency=1000)(EngineActor)
