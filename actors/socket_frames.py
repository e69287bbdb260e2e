"""Messages over a UNIX stream socket, for the channels between an engine and the processes on
its node that talk to it once a step (actors/step_channel.py, actors/output_channel.py).

A frame is an 8-byte length and a pickle of the message dataclasses. Unpickling runs code that
a pickle names, so two things keep it to what Ray's own actor calls already carry between the
same processes:

- a listening socket accepts, and a connecting one keeps, only a peer of this user whose
  process is the one named over Ray (the kernel's SO_PEERCRED); the sockets are abstract (no
  file to clean up) with random names, but any process on the node can list those names;
- the unpickler builds nothing but the dataclasses and exceptions of raypd's own `engine`,
  `worker`, `actors` and `kv` packages and Python's built-in exceptions: a pickle that names
  anything else (a function to call, another class) is refused.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import importlib
import io
import os
import pickle
import socket
import struct
import uuid
from collections.abc import Collection

_LENGTH = struct.Struct("<Q")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_PACKAGES = ("engine", "worker", "actors", "kv")


class PeerRefusedError(ConnectionError):
    """The process at the other end is not the one this channel was opened for."""


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        if module == "builtins":
            found = getattr(builtins, name, None)
            if isinstance(found, type) and issubclass(found, Exception):
                return found
        elif module.split(".")[0] in _PACKAGES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, Exception)):
                return found
        raise pickle.UnpicklingError(f"a channel message may not name {module}.{name}")


def frame(obj: object) -> tuple[bytes, bytes]:
    """For `StreamWriter.writelines`: the body is not copied into a bigger buffer first."""
    body = pickle.dumps(obj, protocol=5)
    return _LENGTH.pack(len(body)), body


def loads(data: bytes) -> object:
    return _MessageUnpickler(io.BytesIO(data)).load()


async def read_frame(reader: asyncio.StreamReader) -> object:
    """Raises IncompleteReadError at the end of the stream. Not to be cancelled mid-frame (the
    stream would be left inside one): readers loop in a task of their own."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return loads(await reader.readexactly(length))


def check_peer(sock: socket.socket, pids: Collection[int]) -> None:
    """Raises PeerRefusedError unless one of processes `pids`, of this user, is at the other end."""
    peer_pid, peer_uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if peer_pid not in pids or peer_uid != os.getuid():
        raise PeerRefusedError(f"the peer is process {peer_pid} of user {peer_uid}, not one of {sorted(pids)}")


def listening_socket(kind: str) -> tuple[socket.socket, str]:
    """A bound abstract UNIX socket and its address; asyncio's servers take the socket (uvloop
    refuses an abstract address given as a path)."""
    address = f"\0raypd-{kind}-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address)
    return sock, address


def connected_socket(address: str, pid: int) -> socket.socket:
    """Connected to `address`, where process `pid` must be listening."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        check_peer(sock, (pid,))
    except OSError:
        sock.close()
        raise
    return sock


async def close_connection(
    reader: asyncio.Task[None] | None, writer: asyncio.StreamWriter | None, sock: socket.socket
) -> None:
    """Stop the task that reads a connecting end, then close it: through its stream once it
    has one, else the bare socket."""
    if reader is not None:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    if writer is not None:
        writer.close()
    else:
        sock.close()
