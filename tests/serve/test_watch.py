"""A replica's router following the controller's engine set (serve/watch.py): engines added,
marked draining, removed, and rebound to a replacement under the same name. The handles are
never called here (the fleet's bookkeeping is under test); tests/scaling/ runs it on real
engines behind real Serve."""

from __future__ import annotations

import asyncio

from api.migration import MigrationPolicy
from api.router import Engine, PDRouter
from serve.controller import EngineSet
from serve.watch import EngineSetWatcher


class _Handle:
    """An actor handle's identity: equal only to itself, as Ray's handles to distinct actors."""

    def __init__(self, name: str) -> None:
        self.name = name


def _router(engines: EngineSet) -> PDRouter:
    return PDRouter(
        [Engine.remote(n, h) for n, h in engines.prefill.items()],
        [Engine.remote(n, h) for n, h in engines.decode.items()],
        MigrationPolicy(),
    )


def _roles(router: PDRouter) -> dict[str, tuple[str, bool]]:
    return {e.name: (router.fleet.state(e.name).role, router.fleet.state(e.name).draining) for e in router.engines}


def test_the_fleet_follows_each_version_of_the_engine_set():
    p0, d0, d1 = _Handle("p0"), _Handle("d0"), _Handle("d1")
    first = EngineSet(1, {"p0": p0}, {"d0": d0})
    router = _router(first)

    async def main():
        watcher = EngineSetWatcher(None, router, first, colocated=False)
        assert watcher.version == 1
        watcher.apply(EngineSet(2, {"p0": p0}, {"d0": d0, "d1": d1}))  # scaled up
        assert _roles(router) == {"p0": ("prefill", False), "d0": ("decode", False), "d1": ("decode", False)}
        watcher.apply(EngineSet(3, {"p0": p0}, {"d1": d1}, draining={"d0": d0}))  # d0 drains
        assert _roles(router)["d0"] == ("decode", True)
        assert [s.name for s in router.fleet.candidates("decode")] == ["d1"]
        p0_new = _Handle("p0 again")
        watcher.apply(EngineSet(4, {"p0": p0_new}, {"d1": d1}))  # d0 stopped, p0 replaced
        assert set(_roles(router)) == {"p0", "d1"}
        assert router.fleet.engine("p0").slot.handle is p0_new
        assert watcher.version == 4
        for _ in range(100):  # the removed engine's client, with no stream on it, is closed at once
            if not watcher._retiring:
                break
            await asyncio.sleep(0.01)
        assert not watcher._retiring

    asyncio.run(main())
