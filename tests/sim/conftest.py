"""The randomized suite's long seeds run only when asked for: `pytest -m sim_long tests/sim`
(`make test-sim-long`); otherwise they are deselected, not reported as skips."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sim_long: the randomized simulation's extra seeds (make test-sim-long)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "sim_long" in (config.getoption("markexpr") or ""):
        return
    long = [item for item in items if "sim_long" in item.keywords]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if "sim_long" not in item.keywords]
