"""Only workers load torch (docs/design.md §14): the modules the engine, the API replicas and
the command line import leave torch, safetensors and NIXL unloaded."""

from __future__ import annotations

import subprocess
import sys

# What each process without a worker imports: the engine actor, the Serve app and its
# controller, the launcher, the command line, and the messages they unpickle.
CONTROL_PLANE = (
    "actors.engine_actor",
    "serve.app",
    "serve.launch",
    "serve.__main__",
    "api.app",
    "kv.nixl.peers",
    "kv.cache_layout",
    "kv.nixl.transfer_stats",
)
WORKER_ONLY = ("torch", "safetensors", "nixl_cu12", "nixl")


def loaded_after_import(modules: tuple[str, ...]) -> list[str]:
    """The `WORKER_ONLY` modules a fresh interpreter holds after importing `modules`."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(m for m in {WORKER_ONLY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_the_control_plane_imports_no_torch():
    assert loaded_after_import(CONTROL_PLANE) == []


def test_the_check_sees_torch_where_it_is_loaded():
    assert "torch" in loaded_after_import(("worker.worker",))
