"""Ports handed to a server that binds them later (Serve's proxy, a TP rendezvous, a test's Ray).

A port from `bind(("", 0))` is free when it is read, but it comes from the kernel's ephemeral
range, which every outgoing connection and every other bind to port 0 draws from too: UCX's
listeners, Ray's agents, gRPC. In the seconds before its server binds it one of them can take
it; CI saw Serve's proxy fail to start so. The kernel never hands out a port below that range,
so one chosen there and checked free can only be taken by a process that names it. Ray's
worker processes name ports 10002-19999 by default, so the choice starts above them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FIRST = 20000  # above Ray's default worker ports (10002-19999)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 1000


def _ephemeral_start() -> int:
    """Where the kernel's own port choices begin; Linux's default where it does not say."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """`n` distinct ports, each bindable on every interface now and outside the ephemeral range.

    Checked without SO_REUSEADDR, as Serve binds: a port some closed connection still holds in
    TIME_WAIT is skipped rather than handed out."""
    rng = rng or random.Random()
    end = _ephemeral_start()
    if end - _FIRST < 64 * n:
        raise RuntimeError(f"no room for fixed ports below the ephemeral range (it starts at {end})")
    held: list[socket.socket] = []
    try:
        for _ in range(_TRIES):
            if len(held) == n:
                break
            s = socket.socket()
            try:
                s.bind(("", rng.randrange(_FIRST, end)))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < n:
            raise RuntimeError(f"found {len(held)} of {n} free ports in {_TRIES} tries in {_FIRST}-{end - 1}")
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    (port,) = free_ports(1)
    return port
