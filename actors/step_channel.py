"""Steps from an engine to a worker on its node over a UNIX socket, not a Ray actor call.

Every step goes to every worker and its result comes back, so what one call costs is paid per
token. A Ray actor call between two async actors costs about 1 ms of CPU, half in each process
(gRPC, the task's bookkeeping, the object's return), against ~40 us for the same message over
a socket (docs/design.md §15). The engine places its workers on its own node, so the socket is
the usual path; a worker Ray puts elsewhere is still reached by actor calls.

The worker listens on an abstract socket (actors/socket_frames.py). The socket is a stream, so
steps reach the worker in the order the engine sent them and need none of the reordering an
actor call's arrival order needs (actors/worker_actor.py); the worker's compute stream runs
them in order, so results come back in that order too. A worker process that dies closes its end, and
every step waiting on it fails with `WorkerLostError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from actors.socket_frames import (
    PeerRefusedError,
    check_peer,
    close_connection,
    connected_socket,
    frame,
    listening_socket,
    loads,
    read_frame,
)
from engine.messages import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


class WorkerLostError(ConnectionError):
    """The worker's end of the step channel closed: its process died or shut down."""


class StepServer:
    """The worker's end. `submit` queues a step on the compute stream; `finish` adds what the
    connector learned meanwhile to its result (both run on the actor's event loop, as the
    actor-call path runs them)."""

    def __init__(
        self,
        submit: Callable[[SchedulerOutput], Future[ModelRunnerOutput]],
        finish: Callable[[ModelRunnerOutput], ModelRunnerOutput],
    ) -> None:
        self._submit = submit
        self._finish = finish
        self._server: asyncio.Server | None = None
        self._engine_pid = 0
        self._address = ""

    async def listen(self, engine_pid: int) -> str:
        """The address process `engine_pid` connects to, listening from the first call. Call it
        on the actor's loop."""
        if not self._address:
            self._engine_pid = engine_pid
            sock, self._address = listening_socket("steps")
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        return self._address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            check_peer(writer.get_extra_info("socket"), (self._engine_pid,))
        except PeerRefusedError as e:
            log.warning("step channel: connection refused: %s", e)
            writer.close()
            return
        results: asyncio.Queue[asyncio.Future[ModelRunnerOutput] | None] = asyncio.Queue()
        sender = asyncio.get_running_loop().create_task(self._send(results, writer))
        try:
            while True:
                try:
                    out = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the engine closed its end
                except Exception:  # unreadable: the stream cannot be trusted past it
                    log.exception("step channel: bad step frame")
                    return
                results.put_nowait(self._start(out))
        finally:
            results.put_nowait(None)
            await sender

    def _start(self, out: object) -> asyncio.Future[ModelRunnerOutput]:
        """The step queued now, in arrival order (the next one may arrive before this ends)."""
        try:
            if not isinstance(out, SchedulerOutput):
                raise TypeError(f"a step channel carries SchedulerOutput, got {type(out).__name__}")
            return asyncio.wrap_future(self._submit(out))
        except Exception as e:
            failed: asyncio.Future[ModelRunnerOutput] = asyncio.get_running_loop().create_future()
            failed.set_exception(e)
            return failed

    async def _send(
        self, results: asyncio.Queue[asyncio.Future[ModelRunnerOutput] | None], writer: asyncio.StreamWriter
    ) -> None:
        try:
            while (pending := await results.get()) is not None:
                try:
                    reply: tuple[bool, object] = (True, self._finish(await pending))
                except Exception as e:
                    log.exception("a step sent over the step channel failed")
                    reply = (False, _picklable(e))
                writer.writelines(frame(reply))
                await writer.drain()
        except ConnectionError:
            pass  # the engine is gone; nothing is left to answer
        finally:
            writer.close()


def _picklable(e: Exception) -> Exception:
    """`e`, or a RuntimeError naming it where the engine's end could not read it back."""
    try:
        loads(frame(e)[1])
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


class StepChannel:
    """The engine's end: call it with a step (in step order) and await the worker's result.

    Calls are synchronous, like the actor-call path's `.remote`, so the engine loop hands a
    step to every worker before it awaits any; the connection is made on the loop at the first
    call, and steps sent before it is up wait in order."""

    def __init__(self, address: str, worker_pid: int) -> None:
        # Fails here, at the engine's start, if the worker is not listening there.
        self._sock = connected_socket(address, worker_pid)
        self._writer: asyncio.StreamWriter | None = None
        self._unsent: list[tuple[bytes, bytes]] = []
        self._waiting: deque[asyncio.Future[ModelRunnerOutput]] = deque()
        self._reader_task: asyncio.Task[None] | None = None
        self._lost: WorkerLostError | None = None

    def __call__(self, out: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[ModelRunnerOutput] = loop.create_future()
        if self._lost is not None:
            result.set_exception(self._lost)
            return result
        self._waiting.append(result)
        if self._writer is not None:
            self._writer.writelines(frame(out))
        else:
            self._unsent.append(frame(out))
            if self._reader_task is None:
                self._reader_task = loop.create_task(self._run())
        return result

    async def close(self) -> None:
        await close_connection(self._reader_task, self._writer, self._sock)
        self._fail(WorkerLostError("the step channel was closed"))

    async def _run(self) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=self._sock)
            for unsent in self._unsent:
                writer.writelines(unsent)
            self._unsent.clear()
            self._writer = writer
            while True:
                reply = await read_frame(reader)
                result = self._waiting.popleft()
                if result.done():
                    continue  # the engine stopped waiting (its loop was cancelled)
                match reply:
                    case (True, ModelRunnerOutput() as output):
                        result.set_result(output)
                    case (False, Exception() as error):
                        result.set_exception(error)
                    case _:
                        result.set_exception(TypeError(f"a step channel reply of {type(reply).__name__}"))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._fail(WorkerLostError(f"the worker closed its step channel: its process ended ({e!r})"))
        except Exception as e:  # a reply this end cannot read, or one nobody waits for
            log.exception("step channel: bad reply")
            self._fail(WorkerLostError(f"the worker's step channel broke: {e!r}"))
            if self._writer is not None:
                self._writer.close()

    def _fail(self, error: WorkerLostError) -> None:
        self._lost = self._lost or error
        while self._waiting:
            result = self._waiting.popleft()
            if not result.done():
                result.set_exception(self._lost)
