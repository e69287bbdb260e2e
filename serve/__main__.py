"""`python -m serve`: serve a model over the OpenAI API until Ctrl-C.

    python -m serve [--model DIR] [--port 8000] [--address RAY_ADDRESS] [--config FILE] ...
    python -m serve --address RAY_ADDRESS --detach ...   # start, leave it running, exit 0
    python -m serve --address RAY_ADDRESS --stop         # stop a detached service

Flags (vLLM's names), a YAML file and `RAYPD_*` variables fill one `Config`, printed at
start-up with the URL. SIGINT or SIGTERM deletes the app, stops the engines and, for a local
cluster, Ray itself, then exits 0. Inside a Ray job (`ray job submit -- python -m serve ...`)
RAY_ADDRESS names the cluster.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from ray.exceptions import RayTaskError

from engine.build import Role, check_tp
from engine.config import Config, ConfigError
from models.model_files import ModelLoadError, load_config
from serve import launch
from serve.config import parse_args


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stop",
        action="store_true",
        help="stop a detached raypd service on the cluster (--address or RAY_ADDRESS) and exit",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, extra=_flags)
    cfg = args.config
    if args.stop:
        return _stop(cfg)
    try:  # fail in a second, not after starting a cluster
        load_config(cfg.model)
    except ModelLoadError as e:
        print(f"raypd: cannot serve {cfg.model}: {e} (`make model` builds the shipped model)", file=sys.stderr)
        return 2
    try:
        roles: tuple[Role, ...] = ("colocated",) if cfg.colocated else ("prefill", "decode")
        for role in roles:
            check_tp(cfg, role)
    except ConfigError as e:
        print(f"raypd: {e}", file=sys.stderr)
        return 2
    if launch.cluster_address(cfg) is None and (taken := _cannot_listen(cfg)):
        print(f"raypd: cannot listen on {cfg.host}:{cfg.port} (--host, --port): {taken}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM only raise a flag: an exception thrown into the middle of a Ray call can
    # crash the process, so a stop during start-up waits for the start to finish. A second
    # signal does interrupt (for a start that hangs).
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():
            raise KeyboardInterrupt
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        dep = launch.start(cfg)
    except Exception as e:  # launch.start has cleaned up; a one-line reason beats Ray's traceback
        print(f"raypd: cannot start: {_reason(e)}", file=sys.stderr)
        return 1
    if cfg.detach:
        print(
            f"{cfg.describe()}\n\nraypd is serving {cfg.model_name!r} at {dep.url}/v1 (detached: "
            "`python -m serve --address ADDRESS --stop` stops it)",
            flush=True,
        )
        launch.leave(dep)
        return 0
    try:
        if not stopping.is_set():
            print(
                f"{cfg.describe()}\n\nraypd is serving {cfg.model_name!r} at {dep.url}/v1 (Ctrl-C stops it)", flush=True
            )
        stopping.wait()
        print("raypd: shutting down", flush=True)
    finally:
        launch.stop(dep)
    return 0


def _cannot_listen(cfg: Config) -> str:
    """Why Serve's proxy could not bind the address, or "". A local cluster puts the proxy on
    this machine, so a port in use is found before the cluster starts; the check binds as Serve
    does, without SO_REUSEADDR."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET) as s:
            s.bind((cfg.host, cfg.port))
    except OSError as e:
        return e.strerror or str(e)
    return ""


def _reason(e: BaseException) -> str:
    """The error an actor raised, without the remote traceback Ray wraps it in."""
    while isinstance(e, RayTaskError) and e.cause is not None:
        e = e.cause
    return str(e)


def _stop(cfg: Config) -> int:
    if launch.cluster_address(cfg) is None:
        print("raypd: --stop needs the cluster: give --address (or set RAY_ADDRESS)", file=sys.stderr)
        return 2
    try:
        names = launch.stop_detached(cfg)
    except ConnectionError as e:
        print(f"raypd: cannot stop: {e}", file=sys.stderr)
        return 1
    print(f"raypd: stopped {', '.join(names)}" if names else "raypd: no engines were running", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
