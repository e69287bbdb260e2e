"""An engine's outputs pushed over a UNIX socket to the client on its node, not polled by Ray calls.

The client (the API replica's `EngineClient`) used to call the engine's `get_outputs` once per
step: one Ray actor call per token at low load, ~1 ms of CPU across the two processes
(docs/design.md §15). When the client is on the engine's node it now asks the engine once, over
Ray, for an output channel, and the engine writes every batch it publishes to that socket as
soon as it is out; the client reads them in a task of its own and hands them to its poller. A
client on another node polls over Ray as before.

One client is served at a time: a new connection (a restarted API replica) replaces the last,
whose pusher stops before it takes another batch. Once the engine has seen a client leave, what
it publishes waits for the next; a batch taken just before it saw that is lost with the client,
whose requests it was. The engine's process ending closes the
socket; the client's read then raises ConnectionError where a `get_outputs` call would have
raised RayActorError, and its requests end with the engine's failure, to be resumed elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from actors.socket_frames import (
    PeerRefusedError,
    check_peer,
    close_connection,
    connected_socket,
    frame,
    listening_socket,
    read_frame,
)
from engine.messages import OutputBatch

log = logging.getLogger(__name__)


class OutputServer:
    """The engine's end. `take` waits for the batches published since it last returned (the
    engine's `get_outputs` without a timeout)."""

    def __init__(self, take: Callable[[], Awaitable[list[OutputBatch]]]) -> None:
        self._take = take
        self._server: asyncio.Server | None = None
        self._pusher: asyncio.Task[None] | None = None
        self._clients: set[int] = set()
        self._address = ""

    async def open_for(self, client_pid: int) -> str:
        """The address process `client_pid` may connect to (listening from the first call)."""
        self._clients.add(client_pid)
        if not self._address:
            sock, self._address = listening_socket("outputs")
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        return self._address

    @property
    def serving(self) -> bool:
        """Whether a client is connected and being pushed to."""
        return self._pusher is not None and not self._pusher.done()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._stop_pusher()

    async def _stop_pusher(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            check_peer(writer.get_extra_info("socket"), self._clients)
        except PeerRefusedError as e:
            log.warning("output channel: connection refused: %s", e)
            writer.close()
            return
        await self._stop_pusher()
        pusher = self._pusher = asyncio.get_running_loop().create_task(self._push(writer))
        # The client sends nothing: reading only tells when it leaves, so the pusher stops
        # before it takes batches another client may be waiting for.
        with contextlib.suppress(ConnectionError):
            await reader.read()
        pusher.cancel()

    async def _push(self, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                batches = await self._take()
                writer.writelines(frame(batches))
                await writer.drain()
        except ConnectionError:
            pass
        except Exception:  # the client sees the socket close and fails its requests over
            log.exception("output channel: pushing failed")
        finally:
            writer.close()


class OutputFeed:
    """The client's end, opened from an address the engine gave over Ray."""

    def __init__(self, address: str, engine_pid: int) -> None:
        self._sock = connected_socket(address, engine_pid)
        self._batches: asyncio.Queue[list[OutputBatch] | BaseException] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self, timeout: float) -> list[OutputBatch]:
        """The batches pushed since the last call, waiting up to `timeout` for the first; raises
        ConnectionError once the engine's end has closed."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            item = await asyncio.wait_for(self._batches.get(), timeout)
        except TimeoutError:
            return []
        batches: list[OutputBatch] = []
        while True:
            if isinstance(item, BaseException):
                self._batches.put_nowait(item)  # every later call fails the same way
                if batches:
                    return batches
                raise item
            batches.extend(item)
            if self._batches.empty():
                return batches
            item = self._batches.get_nowait()

    async def close(self) -> None:
        await close_connection(self._reader, self._writer, self._sock)

    async def _read(self) -> None:
        try:
            reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
            while True:
                batches = await read_frame(reader)
                if not isinstance(batches, list):
                    raise TypeError(f"an output channel carries lists of OutputBatch, got {type(batches).__name__}")
                self._batches.put_nowait(batches)
        except Exception as e:  # the end of the stream, or a frame this client cannot read
            self._batches.put_nowait(ConnectionError(f"the engine's output channel ended: {e!r}"))
