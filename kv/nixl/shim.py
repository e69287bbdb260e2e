"""The one place raypd imports NIXL.

PyPI ships NIXL as `nixl-cu12` / `nixl-cu13` (modules `nixl_cu12` / `nixl_cu13`) and a
meta package `nixl` that pulls in both; the Python API (`nixl_agent`, `nixl_agent_config`)
is the same in each. raypd pins `nixl-cu12`, which also runs on CPU-only machines (DRAM
over UCX tcp/cma). NIXL reports failures as exception classes of its native bindings,
which subclass plain `Exception`; `NIXL_ERRORS` collects them so callers can catch
exactly those.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["NIXL_ERRORS", "nixl_agent", "nixl_agent_config"]


def _load() -> ModuleType:
    try:
        import nixl_cu12._api as api
    except ImportError:
        try:
            import nixl._api as api  # type: ignore[no-redef]
        except ImportError as e:
            raise ImportError(
                "NIXL is not installed: neither `nixl_cu12` (pip install nixl-cu12) nor `nixl` could be imported"
            ) from e
    return api


_api = _load()
nixl_agent = _api.nixl_agent
nixl_agent_config = _api.nixl_agent_config
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    cls
    for name, cls in vars(_api.nixlBind).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(cls, type) and issubclass(cls, Exception)
)
