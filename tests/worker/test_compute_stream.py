"""The compute stream runs jobs one at a time in submission order, even when it lags."""

from __future__ import annotations

import threading
import time

import pytest

from worker.compute_stream import ComputeStream


def test_jobs_run_in_submission_order_on_one_thread():
    stream = ComputeStream("cpu", delay_s=0.01)
    order: list[int] = []
    threads: set[int] = set()

    def job(i: int, pause: float) -> int:
        threads.add(threading.get_ident())
        time.sleep(pause)  # early jobs run longest: a pool of threads would reorder them
        order.append(i)
        return i * i

    futures = [stream.submit(job, i, 0.02 * (5 - i)) for i in range(6)]
    assert not futures[-1].done()  # the submitter runs ahead of the lagging stream
    assert [f.result() for f in futures] == [i * i for i in range(6)]
    assert order == list(range(6))
    assert len(threads) == 1 and threading.get_ident() not in threads
    stream.close()


def test_a_failing_job_fails_its_future_only():
    stream = ComputeStream("cpu")

    def boom() -> None:
        raise RuntimeError("bad step")

    failed, after = stream.submit(boom), stream.submit(lambda: 7)
    with pytest.raises(RuntimeError, match="bad step"):
        failed.result()
    assert after.result() == 7
    stream.close()


def test_close_drains_queued_jobs():
    stream = ComputeStream("cpu", delay_s=0.01)
    done: list[int] = []
    for i in range(3):
        stream.submit(done.append, i)
    stream.close()
    assert done == [0, 1, 2]


def test_negative_delay_is_rejected():
    with pytest.raises(ValueError, match="delay_s"):
        ComputeStream("cpu", delay_s=-1.0)
