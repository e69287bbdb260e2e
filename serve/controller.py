"""The engine controller: one detached named actor that owns the engines of a deployment.

It creates the engines, replaces a failed one (`EngineSupervisor`, serve/engines.py), adds and
drains engines as the load asks (serve/autoscale.py), and publishes the current engine set with
a version. Every API replica watches it (`watch`, a long poll that answers as soon as the
version moves), so an engine added, drained or replaced reaches every replica, and no replica
owns anything: one that dies takes only its own streams with it (docs/design.md §23).

Draining an engine: it leaves the published set first, so the routers send it nothing new;
the controller then waits until it holds nothing (no request running or waiting, every block
free, so a prefill engine's handed-over KV has been read or its lease has ended), at most
`--drain-timeout-s`; only then is it stopped. A request still on it at the deadline meets a
lost engine and resumes on another one token for token (api/migration.py), as after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from engine.build import Role
from engine.config import Config
from serve.autoscale import Hysteresis, Sample, Targets, measure, pressure
from serve.engines import ENGINE_SHUTDOWN_TIMEOUT_S, NAMESPACE, EngineSupervisor, create_engine, engine_dead
from serve.placement import NORMAL_PRIORITY

log = logging.getLogger(__name__)

CONTROLLER_NAME = "raypd-controller"
WATCH_TIMEOUT_S = 30.0
# After a drained engine leaves the set, the time routers have to take the new set before the
# engine is looked at: a request routed just before still lands (and is waited for).
DRAIN_SETTLE_S = 1.0
_DRAIN_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class EngineSet:
    """The engines routers may send new requests to, by role (colocated engines under decode),
    name -> actor handle, and those draining (no new requests; the ones on them go on).
    `version` grows with every change."""

    version: int
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    draining: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """An engine added ("up") or drained and stopped ("down")."""

    role: Role
    direction: str
    name: str


class EngineController:
    def __init__(self, config: dict[str, Any], interval_s: float = 0.5) -> None:
        self.cfg = Config.from_dict(config)
        self.interval_s = interval_s
        self._roles: tuple[Role, ...] = ("colocated",) if self.cfg.colocated else ("prefill", "decode")
        self.supervisor = EngineSupervisor(self.cfg, {}, self._replaced, interval_s=interval_s, roles={})
        self._next_index = dict.fromkeys(self._roles, 0)
        self._draining: dict[str, asyncio.Task[None]] = {}
        self._adding: dict[Role, asyncio.Task[str]] = {}
        self._version = 0
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()  # one change of the engine set at a time
        self._loop: asyncio.Task[None] | None = None
        self._targets = Targets.of(self.cfg)
        self._scalers = {
            role: Hysteresis(
                *self.cfg.engine_range(_count_role(role)), self.cfg.scale_up_delay_s, self.cfg.scale_down_delay_s
            )
            for role in self._roles
        }
        self._samples: dict[str, Sample] = {}
        self.events: list[ScaleEvent] = []

    async def start(self) -> EngineSet:
        """Create the configured engines, wire them, and start watching and scaling them."""
        async with self._lock:
            if self._loop is None:
                counts = {"prefill": self.cfg.prefill, "decode": self.cfg.decode, "colocated": self.cfg.decode}
                new = [(self._new_name(role), role) for role in self._roles for _ in range(counts[role])]
                handles = [await self._create(name, role) for name, role in new]
                for (name, role), handle in zip(new, handles, strict=True):
                    self.supervisor.add(name, role, handle)  # so that `shutdown` stops it, ready or not
                await asyncio.gather(*(h.ready.remote() for h in handles))
                for (name, role), handle in zip(new, handles, strict=True):
                    if role == "decode":  # every prefill engine is in by now
                        await self.supervisor.wire(name, role, handle)
                self._publish()
                self._loop = asyncio.get_running_loop().create_task(self._run())
        return self.engine_set()

    def engine_set(self) -> EngineSet:
        sup = self.supervisor
        serving = {n: r for n, r in sup.roles.items() if n not in self._draining}
        return EngineSet(
            self._version,
            {n: sup.handles[n] for n, r in serving.items() if r == "prefill"},
            {n: sup.handles[n] for n, r in serving.items() if r != "prefill"},
            {n: sup.handles[n] for n in self._draining if n in sup.handles},
        )

    async def watch(self, version: int, timeout_s: float = WATCH_TIMEOUT_S) -> EngineSet:
        """The engine set once its version is not `version`, or after `timeout_s` as it is."""
        if version == self._version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.engine_set()

    async def add_engine(self, role: Role) -> str:
        """Start one more engine of `role` (the autoscaler's step up; tests and operators too).
        Its start is waited for outside the lock: an engine waiting for a node (the cluster
        autoscaler's) holds up no replacement of a failed one."""
        name = self._new_name(role)
        handle = await self._create(name, role)
        try:
            await handle.ready.remote()
            async with self._lock:
                await self.supervisor.wire(name, role, handle)
                self.supervisor.add(name, role, handle)
                self.events.append(ScaleEvent(role, "up", name))
                self._publish()
        except BaseException:
            await _stop(handle, name)
            raise
        log.warning("engine %s (%s) added", name, role)
        return name

    async def drain(self, name: str) -> None:
        """Take `name` out of the set, wait for it to hold nothing, stop it (module docstring)."""
        if name not in self.supervisor.roles:
            raise ValueError(f"no engine {name} (engines: {', '.join(self.supervisor.roles)})")
        await asyncio.shield(self._draining.get(name) or self._start_drain(name))

    def scale_events(self) -> list[ScaleEvent]:
        return list(self.events)

    def draining(self) -> list[str]:
        return sorted(self._draining)

    async def shutdown(self) -> list[str]:
        """Stop watching and scaling, and stop every engine; the names stopped."""
        tasks = [t for t in (self._loop, *self._draining.values(), *self._adding.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        names = list(self.supervisor.roles)
        await asyncio.gather(*(_stop(self.supervisor.remove(n), n) for n in names))
        self._publish()
        return names

    # -- inside ---------------------------------------------------------------------

    def _new_name(self, role: Role) -> str:
        index = self._next_index[role]
        self._next_index[role] += 1
        return f"raypd-engine-{index}" if role == "colocated" else f"raypd-{role}-{index}"

    async def _create(self, name: str, role: Role) -> Any:
        return create_engine(self.cfg, name, role)

    def _publish(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _replaced(self, name: str, handle: Any) -> None:
        self._publish()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            async with self._lock:
                await self.supervisor.check()
            if self.cfg.autoscaling:
                try:
                    await self._scale()
                except Exception:
                    log.exception("autoscaling step failed; trying again")

    async def _scale(self) -> None:
        now = time.monotonic()
        samples = {n: Sample(now, s) for n, s in self.supervisor.latest.items()}
        for role in self._roles:
            serving = [n for n in self.supervisor.names(role) if n not in self._draining]
            current = {n: samples[n] for n in serving if n in samples}
            load = measure("prefill" if role == "prefill" else "decode", current, self._samples)
            level = pressure("prefill" if role == "prefill" else "decode", load, self._targets)
            step = self._scalers[role].decide(len(serving), level, now)
            if role in self._adding:
                continue  # its last step up is still starting: decide on what it changes
            if step > 0:
                log.warning("%s engines at %.2f of their targets (%s): adding one", role, level, load)
                task = self._adding[role] = asyncio.get_running_loop().create_task(self.add_engine(role))
                task.add_done_callback(lambda t, role=role: self._added(role, t))
            elif step < 0 and len(serving) > 1:
                # The engine with the least on it: its drain ends soonest.
                name = min(serving, key=lambda n: _held(samples.get(n)))
                log.warning("%s engines at %.2f of their targets (%s): draining %s", role, level, load, name)
                self._start_drain(name)
        self._samples = samples

    def _added(self, role: Role, task: asyncio.Task[str]) -> None:
        del self._adding[role]
        if not task.cancelled() and task.exception() is not None:
            log.error("could not add a %s engine: %r", role, task.exception())

    def _start_drain(self, name: str) -> asyncio.Task[None]:
        task = self._draining[name] = asyncio.get_running_loop().create_task(self._drain(name))
        self._publish()  # out of the set the routers choose from, from now
        return task

    async def _drain(self, name: str) -> None:
        await asyncio.sleep(DRAIN_SETTLE_S)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while time.monotonic() < deadline:
            handle = self.supervisor.handles.get(name)
            if handle is None:
                break
            try:
                stats = await asyncio.wait_for(handle.stats.remote(), 5.0)
            except TimeoutError:
                continue
            except Exception as e:
                if engine_dead(e):
                    break
                continue
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total:
                break
            await asyncio.sleep(_DRAIN_POLL_S)
        else:
            log.warning("engine %s still holds requests after %d s: stopping it", name, self.cfg.drain_timeout_s)
        async with self._lock:
            role = self.supervisor.roles[name]
            handle = self.supervisor.remove(name)
            await _stop(handle, name)
            if role == "prefill":  # its agents are gone: never read from again
                decode = self.supervisor.names("decode")
                await asyncio.gather(
                    *(self.supervisor.handles[n].forget_nixl_engine.remote(name) for n in decode),
                    return_exceptions=True,
                )
            del self._draining[name]
            self._samples.pop(name, None)
            self.events.append(ScaleEvent(role, "down", name))
            self._publish()
        log.warning("engine %s (%s) drained and stopped", name, role)


def _count_role(role: Role) -> str:
    """The config's count a role is sized by: colocated engines are counted as decode ones."""
    return "prefill" if role == "prefill" else "decode"


def _held(sample: Sample | None) -> int:
    return 0 if sample is None else sample.stats.num_running + sample.stats.num_waiting


async def _stop(handle: Any, name: str) -> None:
    try:
        await asyncio.wait_for(handle.shutdown.remote(), ENGINE_SHUTDOWN_TIMEOUT_S)
    except Exception:  # an engine that is already dead needs no shutdown
        log.debug("engine %s did not shut down cleanly", name, exc_info=True)
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)


# Control-plane actor: it computes nothing. Detached and named, so that it outlives the process
# that started it (a `ray job submit` driver, `serve run`) and every API replica finds it.
RemoteController = ray.remote(num_cpus=0, max_concurrency=1000)(EngineController)


def controller_options(get_if_exists: bool = True) -> dict[str, Any]:
    """`.options(...)` of the controller: `get_if_exists` takes over a running one (a Serve
    application deployed again); without it, a running one is an error (ValueError)."""
    return {
        "name": CONTROLLER_NAME,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": get_if_exists,
        "runtime_env": NORMAL_PRIORITY,
    }


def stop_controller(timeout_s: float = 60.0) -> list[str]:
    """Stop the running controller and every engine it owns; the engines' names (none if no
    controller was running)."""
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return []
    try:
        return ray.get(controller.shutdown.remote(), timeout=timeout_s)
    except Exception:
        log.warning("the engine controller did not shut down cleanly", exc_info=True)
        return []
    finally:
        with contextlib.suppress(Exception):
            ray.kill(controller, no_restart=True)
