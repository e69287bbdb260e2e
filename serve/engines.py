"""The engine actors of a deployment: created by name, wired to their NIXL peers, and replaced
when one dies or its step loop fails.

Engines are detached named actors, so whoever watches them (the API ingress) can re-create one
under the same name, and they do not die with the process that happened to create them. A
replacement is a fresh scheduler, worker, cache and NIXL agent: a decode engine gets every
prefill worker's agent again, a prefill engine's new agent goes to every decode engine. The
requests that were in flight on the dead engine are resumed by the router on another engine
(api/migration.py); nothing is retried here. Decode engines also get the prefill engines' actor
handles, to renew the leases of the KV they have yet to read (actors/lease.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError

from actors.client import engine_lost
from actors.engine_actor import RemoteEngine
from engine.build import Role
from engine.config import Config
from engine.messages import EngineStats
from serve.placement import engine_options, worker_options

log = logging.getLogger(__name__)

NAMESPACE = "raypd"
_NAME_FREE_TIMEOUT_S = 20.0
ENGINE_SHUTDOWN_TIMEOUT_S = 10.0


def engine_roles(cfg: Config) -> dict[str, Role]:
    """Actor name -> role, prefill engines first."""
    if cfg.colocated:
        return {f"raypd-engine-{i}": "colocated" for i in range(cfg.decode)}
    return {
        **{f"raypd-prefill-{i}": "prefill" for i in range(cfg.prefill)},
        **{f"raypd-decode-{i}": "decode" for i in range(cfg.decode)},
    }


def engine_names(cfg: Config) -> dict[str, list[str]]:
    """Actor names by role; colocated engines stand in the "decode" list."""
    roles = engine_roles(cfg)
    return {
        "prefill": [n for n, r in roles.items() if r == "prefill"],
        "decode": [n for n, r in roles.items() if r != "prefill"],
    }


def create_engine(cfg: Config, name: str, role: Role) -> Any:
    cluster = ray.cluster_resources()
    return RemoteEngine.options(
        name=name, namespace=NAMESPACE, lifetime="detached", **engine_options(cfg, role, cluster)
    ).remote(cfg.to_dict(), role, name, worker_options(cfg, role, cluster))


def start_engines(cfg: Config, engines: dict[str, Any]) -> dict[str, list[str]]:
    """Create the named engine actors into `engines` (so a caller can clean up after a failure
    part-way), wait until they are ready, and give every decode engine every prefill worker's
    NIXL agent (metadata through Ray). Returns the names by role."""
    for name, role in engine_roles(cfg).items():
        engines[name] = create_engine(cfg, name, role)
    ray.get([h.ready.remote() for h in engines.values()])
    names = engine_names(cfg)
    if names["prefill"]:
        peers = [p for ps in ray.get([engines[n].nixl_peers.remote() for n in names["prefill"]]) for p in ps]
        ray.get([engines[n].add_nixl_peers.remote(peers) for n in names["decode"]])
        prefill = {n: engines[n] for n in names["prefill"]}
        ray.get([engines[n].set_lease_peers.remote(prefill) for n in names["decode"]])
    return names


def stop_engines(names: list[str], timeout_s: float = ENGINE_SHUTDOWN_TIMEOUT_S) -> None:
    """Shut down and kill the named engines that exist (replacements included), and return once
    their names are free: a deployment started next on the same cluster creates them again."""
    killed = []
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue  # never created, or already gone
        try:
            ray.get(handle.shutdown.remote(), timeout=timeout_s)
        except Exception:  # an engine that is already dead needs no shutdown
            log.debug("engine %s did not shut down cleanly", name, exc_info=True)
        try:
            ray.kill(handle)
            killed.append(name)
        except Exception:
            log.debug("engine %s could not be killed", name, exc_info=True)
    deadline = time.monotonic() + _NAME_FREE_TIMEOUT_S
    for name in killed:
        while _name_taken(name) and time.monotonic() < deadline:
            time.sleep(0.05)


def _name_taken(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def engine_dead(error: BaseException) -> bool:
    """Whether a probe's error means the engine is gone for good, so that it is replaced: its
    actor died, or its step loop failed. Ray's ActorUnavailableError is not death: a call that
    could not reach the actor this time while Ray does not know it to be dead ("the task may or
    may not have been executed"), which a busy or stalled process gives as well as a dying one;
    killing it would drop every request it holds. A dead engine's next probe says so. (A
    request's call that meets it does go elsewhere: see `engine_lost`.)"""
    return engine_lost(error) and not isinstance(error, ActorUnavailableError)


class EngineSupervisor:
    """Looks at every engine each `interval_s` and replaces the failed ones. `on_replaced`
    gets the new handle, so the routers' clients reach the new actor. The engine set may change
    while it runs (`add`, `remove`: the controller's autoscaling, serve/controller.py); each
    probe's answer is kept in `latest` for the autoscaler to read."""

    def __init__(
        self,
        cfg: Config,
        handles: dict[str, Any],
        on_replaced: Callable[[str, Any], None],
        interval_s: float = 0.5,
        probe_timeout_s: float = 5.0,
        roles: dict[str, Role] | None = None,
    ) -> None:
        self.cfg = cfg
        self.roles = dict(engine_roles(cfg) if roles is None else roles)
        self.handles = dict(handles)
        self.on_replaced = on_replaced
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.num_replaced = 0
        self.latest: dict[str, EngineStats] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()

    async def check(self) -> None:
        """Probe every engine once, replacing those that failed."""
        for name in list(self.roles):
            if name in self.roles and await self._failed(name):
                try:
                    await self.replace(name)
                except Exception:
                    log.exception("could not replace engine %s; trying again", name)

    def names(self, role: Role) -> list[str]:
        return [n for n, r in self.roles.items() if r == role]

    def add(self, name: str, role: Role, handle: Any) -> None:
        """Watch a new engine (already wired: `wire`)."""
        self.roles[name] = role
        self.handles[name] = handle

    def remove(self, name: str) -> Any:
        """Stop watching `name` (it is being stopped); its handle."""
        del self.roles[name]
        self.latest.pop(name, None)
        return self.handles.pop(name)

    async def _failed(self, name: str) -> bool:
        try:
            self.latest[name] = await asyncio.wait_for(self.handles[name].stats.remote(), self.probe_timeout_s)
        except TimeoutError:
            return False  # busy is not dead
        except Exception as e:
            if engine_dead(e):
                return True
            log.warning("engine %s did not answer its probe (%r); probing again", name, e)
        return False

    async def replace(self, name: str) -> None:
        role = self.roles[name]
        log.warning("engine %s (%s) failed: replacing it", name, role)
        try:
            ray.kill(self.handles[name], no_restart=True)
        except Exception:
            log.debug("engine %s was already gone", name, exc_info=True)
        handle = await self._create(name, role)
        await handle.ready.remote()
        await self.wire(name, role, handle)
        self.handles[name] = handle
        self.num_replaced += 1
        self.on_replaced(name, handle)
        log.warning("engine %s is back", name)

    async def wire(self, name: str, role: Role, handle: Any) -> None:
        """Connect a new (or re-created) engine to the others: a decode engine gets every prefill
        worker's NIXL agent and the prefill engines' handles for its leases; a prefill engine's
        agents go to every decode engine, after any earlier incarnation's."""
        if role == "decode":
            prefill = self.names("prefill")
            peers = await asyncio.gather(*(self.handles[n].nixl_peers.remote() for n in prefill))
            await handle.add_nixl_peers.remote([p for ps in peers for p in ps])
            await handle.set_lease_peers.remote({n: self.handles[n] for n in prefill})
        elif role == "prefill":
            decode = [n for n in self.names("decode") if n != name]
            # The dead incarnation's agents go first: never read from again (docs/design.md §12).
            await asyncio.gather(*(self.handles[n].forget_nixl_engine.remote(name) for n in decode))
            peers = await handle.nixl_peers.remote()
            await asyncio.gather(*(self.handles[n].add_nixl_peers.remote(peers) for n in decode))
            await asyncio.gather(*(self.handles[n].set_lease_peers.remote({name: handle}) for n in decode))

    async def _create(self, name: str, role: Role) -> Any:
        """The dead actor's name is freed a moment after the kill; until then creation fails."""
        deadline = time.monotonic() + _NAME_FREE_TIMEOUT_S
        while True:
            try:
                return create_engine(self.cfg, name, role)
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
