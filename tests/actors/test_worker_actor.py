"""The worker as a Ray actor gives the same steps as the worker in process, also with a
step submitted before the previous one returned, or arriving ahead of it."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch

from actors.worker_actor import RemoteWorker, WorkerActor
from engine.messages import ModelRunnerOutput, SchedulerOutput
from tests.huge_pages import huge_kib_at, thp_mode
from tests.models.hf_fixtures import save_hf_model
from tests.ray_session import stop_actors
from tests.worker.test_worker import BLOCK, PROMPTS, Driver, make_worker
from worker.config import WorkerConfig


def assert_same(remote: list[ModelRunnerOutput], local: list[ModelRunnerOutput]) -> None:
    """Tokens exactly; logprobs up to the float reordering of a different thread count."""
    assert [(r.step_id, r.sampled, r.num_zeroed_blocks) for r in remote] == [
        (r.step_id, r.sampled, r.num_zeroed_blocks) for r in local
    ]
    for r, w in zip(remote, local):
        assert r.logprobs.keys() == w.logprobs.keys()
        assert all(abs(r.logprobs[k] - w.logprobs[k]) < 1e-4 for k in r.logprobs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("nemotron_h")
    save_hf_model("nemotron_h", out)
    return str(out)


@pytest.fixture
def actor(ray_cluster, checkpoint):
    handle = RemoteWorker.remote(
        WorkerConfig(checkpoint, block_size=BLOCK, num_kv_blocks=64, stream_delay_s=0.02), num_threads=1
    )
    assert ray.get(handle.ready.remote())
    yield handle
    stop_actors(handle)


def test_actor_steps_equal_in_process_worker(actor, checkpoint):
    local = make_worker(checkpoint)
    assert ray.get(actor.layout.remote()) == local.layout
    drv = Driver(local)
    for req_id, prompt in PROMPTS.items():
        drv.add(req_id, prompt)
    steps = [drv.build({r: len(p) for r, p in PROMPTS.items()})]
    steps += [drv.build({r: 1 for r in PROMPTS}) for _ in range(4)]
    # Async scheduling: every step is queued before the first one's result is read.
    remote = ray.get([actor.execute_model.remote(s) for s in steps])
    assert_same(remote, [local.execute_model_sync(s) for s in steps])
    assert all(len(r.sampled) == 3 for r in remote)
    local.close()


def test_early_step_waits_for_its_predecessor_and_errors_reach_the_caller(actor, checkpoint):
    local = make_worker(checkpoint)
    drv = Driver(local)
    drv.add("a", PROMPTS["a"])
    prefill, decode = drv.build({"a": 7}), drv.build({"a": 1})
    later = actor.execute_model.remote(decode)
    earlier = actor.execute_model.remote(prefill)
    assert_same(ray.get([earlier, later]), [local.execute_model_sync(prefill), local.execute_model_sync(decode)])
    ghost = ray.get(actor.execute_model.remote(SchedulerOutput(2, [], [], {"ghost": 1}, [], None)))
    assert "unknown to the worker" in ghost.failed_reqs["ghost"]
    with pytest.raises(ray.exceptions.RayTaskError, match="already ran"):
        ray.get(actor.execute_model.remote(SchedulerOutput(2, [], [], {}, [], None)))
    local.close()


def test_num_threads_is_applied(checkpoint):
    before = torch.get_num_threads()
    try:
        WorkerActor(WorkerConfig(checkpoint, block_size=BLOCK, num_kv_blocks=8), num_threads=1).shutdown()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_step_whose_predecessor_never_comes_times_out(checkpoint):
    worker = WorkerActor(WorkerConfig(checkpoint, block_size=BLOCK, num_kv_blocks=8), step_wait_s=0.05)
    with pytest.raises(TimeoutError, match=r"step 1 waited .* for step 0"):
        asyncio.run(worker.execute_model(SchedulerOutput(1, [], [], {}, [], None)))
    worker.shutdown()


@pytest.mark.skipif(thp_mode() != "madvise", reason="huge pages only on request (THP 'madvise') show the knob")
def test_worker_kv_cache_sits_on_huge_pages(ray_cluster, checkpoint):
    """A same-host READ walks the source's pages one by one (kv/nixl/host_pages.py): the worker's
    cache asks for transparent huge pages, which this kernel gives only to memory that asks."""
    handle = RemoteWorker.remote(WorkerConfig(checkpoint, block_size=BLOCK, num_kv_blocks=8192), num_threads=1)
    try:
        layout = ray.get(handle.layout.remote())
        assert layout.num_blocks * layout.page_bytes >= 8 << 20, layout
        # Pages arrive on first touch (a step or a READ writes them); touch them all here.
        pid, addrs = ray.get(
            handle.__ray_call__.remote(
                lambda self: (os.getpid(), [b.fill_(0).data_ptr() for b in self._worker.buffers])
            )
        )
        assert all(huge_kib_at(pid, a) >= 2048 for a in addrs)
    finally:
        stop_actors(handle)
