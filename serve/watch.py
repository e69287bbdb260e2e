"""An API replica's view of the engine set: it follows the engine controller (serve/controller.py).

Each replica long-polls the controller's `watch` and applies every new version to its router's
fleet (api/routing/fleet.py): a new engine is added, an engine leaving the set is marked
draining (no new request goes there; those on it go on), one gone from the controller
altogether is removed, and a replaced engine's new actor is rebound under its name, so its
clients reach it. Routing state is per replica, derived from the engine summaries each one
pulls; what every replica shares is this set. A controller that cannot be reached leaves the
replica serving on the set it has, and it asks again with a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from api.router import Engine, Router
from api.routing.fleet import FleetRole
from serve.controller import WATCH_TIMEOUT_S, EngineSet

log = logging.getLogger(__name__)

_BACKOFF_S = (0.5, 5.0)
# A removed engine's client is closed once no request of this replica is left on it.
_RETIRE_POLL_S = 0.5
_RETIRE_MAX_S = 600.0


class EngineSetWatcher:
    def __init__(self, controller: Any, router: Router, engines: EngineSet, colocated: bool) -> None:
        self.controller = controller
        self.router = router
        self.version = -1
        self._decode_role: FleetRole = "colocated" if colocated else "decode"
        self._retiring: set[asyncio.Task[None]] = set()
        self.apply(engines)

    def apply(self, engines: EngineSet) -> None:
        """Make the router's fleet match `engines`."""
        fleet = self.router.fleet
        known = {e.name: e for e in fleet.engines}
        wanted: dict[str, tuple[Any, FleetRole]] = {
            **{n: (h, "prefill") for n, h in engines.prefill.items()},
            **{n: (h, self._decode_role) for n, h in engines.decode.items()},
        }
        for name, (handle, role) in wanted.items():
            engine = known.get(name)
            if engine is None:
                fleet.add(Engine.remote(name, handle), role)
                continue
            if engine.slot is not None and engine.slot.handle != handle:
                engine.rebind(handle)
            fleet.drain(name, False)
        for name, handle in engines.draining.items():
            engine = known.get(name)
            if engine is not None:
                if engine.slot is not None and engine.slot.handle != handle:
                    engine.rebind(handle)
                fleet.drain(name)
        for name in known.keys() - wanted.keys() - engines.draining.keys():
            self._retire(fleet.remove(name))
        self.version = engines.version

    async def run(self) -> None:
        backoff = _BACKOFF_S[0]
        while True:
            try:
                engines = await self.controller.watch.remote(self.version, WATCH_TIMEOUT_S)
            except Exception as e:
                log.warning("engine controller unreachable (%r): serving on engine set %d", e, self.version)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _BACKOFF_S[1])
                continue
            backoff = _BACKOFF_S[0]
            if engines.version != self.version:
                self.apply(engines)

    def _retire(self, engine: Engine) -> None:
        task = asyncio.get_running_loop().create_task(self._close_when_idle(engine))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _close_when_idle(engine: Engine) -> None:
        """Closing a client with streams on it would leave them waiting: its poller ends them
        (with the engine's failure, which resumes them elsewhere) once the engine is gone."""
        waited = 0.0
        while engine.client.num_active and waited < _RETIRE_MAX_S:
            await asyncio.sleep(_RETIRE_POLL_S)
            waited += _RETIRE_POLL_S
        with contextlib.suppress(Exception):
            await engine.client.close()
