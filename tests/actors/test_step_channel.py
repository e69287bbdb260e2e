"""The step channel on real UNIX sockets, with a worker end that runs steps on one thread in
order, as a compute stream does: steps sent back to back come back in order, a step the worker
refuses fails alone, and a worker end that goes away fails what waits on it."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

import pytest

from actors.step_channel import StepChannel, StepServer, WorkerLostError
from engine.messages import ModelRunnerOutput, SchedulerOutput


def step(step_id: int, tokens: int = 1) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], [], {"r": tokens}, [], None)


class OneThreadWorker:
    """Runs steps on one thread, in order, each taking `delay_s`; a step out of order is refused
    as `Worker.execute_model` refuses it. Results say which step they answer and what was
    finished since."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.last = -1
        self.finished = 0
        self._thread = ThreadPoolExecutor(max_workers=1)

    def submit(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if out.step_id <= self.last:
            raise ValueError(f"step {out.step_id} submitted after step {self.last}")
        self.last = out.step_id
        return self._thread.submit(self._run, out)

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.delay_s)
        return ModelRunnerOutput(out.step_id, {"r": 10 * out.step_id + out.num_scheduled_tokens["r"]})

    def finish(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        self.finished += 1
        return ModelRunnerOutput(result.step_id, result.sampled, failed_reqs={"n": str(self.finished)})


async def connected(worker: OneThreadWorker) -> tuple[StepServer, StepChannel]:
    server = StepServer(worker.submit, worker.finish)
    return server, StepChannel(await server.listen(os.getpid()), os.getpid())


def test_steps_sent_back_to_back_come_back_in_order():
    async def main():
        worker = OneThreadWorker(delay_s=0.01)
        server, channel = await connected(worker)
        sent = [channel(step(i, tokens=i % 3 + 1)) for i in range(6)]  # none awaited before all are sent
        got = await asyncio.gather(*sent)
        await channel.close()
        server.close()
        return got

    got = asyncio.run(main())
    assert [r.step_id for r in got] == list(range(6))
    assert [r.sampled["r"] for r in got] == [10 * i + i % 3 + 1 for i in range(6)]
    assert [r.failed_reqs["n"] for r in got] == [str(i + 1) for i in range(6)]


def test_a_step_the_worker_refuses_fails_alone():
    async def main():
        worker = OneThreadWorker()
        server, channel = await connected(worker)
        first = await channel(step(0))
        with pytest.raises(ValueError, match="step 0 submitted after step 0"):
            await channel(step(0))
        after = await channel(step(1))
        await channel.close()
        server.close()
        return first, after

    first, after = asyncio.run(main())
    assert (first.step_id, after.step_id) == (0, 1)


def serve_in_this_process(conn: Connection, engine_pid: int) -> None:
    """A worker end in a process of its own, whose steps take a long time."""

    async def main() -> None:
        worker = OneThreadWorker(delay_s=30.0)
        server = StepServer(worker.submit, worker.finish)
        conn.send(await server.listen(engine_pid))
        await asyncio.sleep(60)

    asyncio.run(main())


def test_a_worker_process_that_dies_fails_the_steps_waiting_and_later_ones():
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=serve_in_this_process, args=(child, os.getpid()), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(60), "the worker process did not listen"
        address = parent.recv()

        async def main():
            channel = StepChannel(address, proc.pid)
            waiting = channel(step(0))
            await asyncio.sleep(0.2)  # the worker has the step
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(WorkerLostError, match="closed its step channel"):
                await asyncio.wait_for(waiting, 10)
            with pytest.raises(WorkerLostError):
                await channel(step(1))
            await channel.close()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.join()


def test_connecting_to_no_worker_fails_at_once():
    with pytest.raises(ConnectionRefusedError):
        StepChannel("\0raypd-steps-nobody-listens", os.getpid())
