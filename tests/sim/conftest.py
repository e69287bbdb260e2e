"""The randomized suite's long seeds run only when asked for: `pytest -m sim_long tests/sim`
(`make test-sim-long`); otherwise they are deselected, not reported as skips.
RAYPD_SIM_LONG_SEEDS=N keeps the first N long seeds (`make test-sim-long SIM_LONG_SEEDS=N`, which
CI uses to bound its run); the rest are deselected."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sim_long: the randomized simulation's extra seeds (make test-sim-long)")


def _seed(item: pytest.Item) -> int:
    callspec = getattr(item, "callspec", None)
    return int(callspec.params["seed"]) if callspec is not None and "seed" in callspec.params else -1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long = [item for item in items if "sim_long" in item.keywords]
    if "sim_long" not in (config.getoption("markexpr") or ""):
        drop = long
    else:
        limit = os.environ.get("RAYPD_SIM_LONG_SEEDS", "")
        if not limit:
            return
        if not limit.isdigit():
            raise pytest.UsageError(f"RAYPD_SIM_LONG_SEEDS={limit!r}: give a number of seeds")
        kept = set(sorted({_seed(item) for item in long})[: int(limit)])
        drop = [item for item in long if _seed(item) not in kept]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if id(item) not in dropped]
