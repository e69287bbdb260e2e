"""A Worker driven by hand-built scheduler outputs on tiny random checkpoints: its tokens
equal the reference greedy driver's through prefill, chunking, async steps, preemption,
and stale pages that only zeroing makes safe."""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field, replace

import pytest
import torch

from engine.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from kernels.cpu import ops as cpu_kernels
from models.reference import greedy_generate
from tests.models.hf_fixtures import save_hf_model
from worker.config import WorkerConfig
from worker.worker import Worker

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, logprobs=True)
PROMPTS = {"a": [5, 17, 33, 2, 9, 41, 8], "b": [60, 3, 12], "c": [7, 7, 21, 30, 44, 52, 11, 4, 19, 23, 6, 15, 27]}


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3"])
def checkpoint(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, out)
    return str(out)


def make_worker(path: str, **kw) -> Worker:
    """A worker whose every page starts as fp32 NaN bits, the worst stale content there is."""
    worker = Worker(WorkerConfig(path, block_size=BLOCK, num_kv_blocks=kw.pop("num_kv_blocks", 64), **kw))
    for buf in worker.buffers:
        buf.view(torch.float32).fill_(float("nan"))
    return worker


@dataclass
class _Req:
    prompt: list[int]
    sampling: SamplingParams
    blocks: list[list[int]]
    num_computed: int = 0
    outputs: list[int] = field(default_factory=list)
    sent: bool = False
    resumed: bool = False


class Driver:
    """Just enough scheduler to drive a worker: blocks from a free list (freed blocks are
    reused first), one Mamba slot per request, every new attention block on the zero list."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.groups = worker.layout.groups
        self.free = list(range(worker.layout.num_blocks))
        self.reqs: dict[str, _Req] = {}
        self.finished: list[str] = []
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], sampling: SamplingParams = GREEDY) -> None:
        self.reqs[req_id] = _Req(list(prompt), sampling, [[] for _ in self.groups])

    def build(self, schedule: dict[str, int], zero: bool = True) -> SchedulerOutput:
        new_reqs, cached, to_zero = [], [], []
        for req_id, n in schedule.items():
            req = self.reqs[req_id]
            added = []
            for ids, group in zip(req.blocks, self.groups):
                need = 1 if group.kind == "mamba" else math.ceil((req.num_computed + n) / BLOCK)
                more = [self.free.pop(0) for _ in range(need - len(ids))]
                ids.extend(more)
                added.append(more)
                to_zero += more if group.kind == "attention" else []
            if not req.sent:
                new_reqs.append(
                    NewRequestData(req_id, req.prompt, req.sampling, [list(b) for b in req.blocks], req.num_computed)
                )
            else:
                cached.append(CachedRequestData(req_id, req.num_computed, added, resumed=req.resumed))
            req.sent, req.resumed = True, False
            req.num_computed += n
        out = SchedulerOutput(
            self.step_id, new_reqs, cached, dict(schedule), self.finished, to_zero if zero and to_zero else None
        )
        self.step_id, self.finished = self.step_id + 1, []
        return out

    def record(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        for req_id, token in result.sampled.items():
            self.reqs[req_id].outputs.append(token)
        return result

    def step(self, schedule: dict[str, int], zero: bool = True) -> ModelRunnerOutput:
        return self.record(self.worker.execute_model_sync(self.build(schedule, zero)))

    def decode(self, req_ids: list[str], steps: int) -> None:
        for _ in range(steps):
            self.step({r: 1 for r in req_ids})

    def finish(self, req_id: str) -> None:
        req = self.reqs.pop(req_id)
        self.free[:0] = [b for ids in req.blocks for b in ids]
        self.finished.append(req_id)

    def preempt(self, req_id: str) -> None:
        """Free the request's blocks without telling the worker; it is resumed later."""
        req = self.reqs[req_id]
        self.free[:0] = [b for ids in req.blocks for b in ids]
        req.blocks, req.num_computed, req.resumed = [[] for _ in self.groups], 0, True


def reference(worker: Worker, prompts: list[list[int]], new: int) -> list[list[int]]:
    return greedy_generate(worker.model, prompts, new, None, block_size=BLOCK)


def test_prefill_together_then_decode_matches_reference(checkpoint):
    worker = make_worker(checkpoint)
    drv = Driver(worker)
    for req_id, prompt in PROMPTS.items():
        drv.add(req_id, prompt)
    first = drv.step({r: len(p) for r, p in PROMPTS.items()})
    attn_groups = sum(g.kind == "attention" for g in worker.layout.groups)
    assert set(first.sampled) == set(PROMPTS) and first.num_zeroed_blocks == attn_groups * (2 + 1 + 4)
    assert all(math.isfinite(lp) for lp in first.logprobs.values())
    drv.decode(list(PROMPTS), 9)
    assert [drv.reqs[r].outputs for r in PROMPTS] == reference(worker, list(PROMPTS.values()), 10)
    worker.close()


def test_chunked_prefill_next_to_decodes(checkpoint):
    worker = make_worker(checkpoint)
    drv = Driver(worker)
    drv.add("b", PROMPTS["b"])
    drv.step({"b": 3})
    drv.add("c", PROMPTS["c"])
    chunk_steps = []
    while drv.reqs["c"].num_computed < len(PROMPTS["c"]):
        n = min(5, len(PROMPTS["c"]) - drv.reqs["c"].num_computed)
        chunk_steps.append(drv.step({"b": 1, "c": n}).sampled)
    assert ["c" in s for s in chunk_steps] == [False, False, True]  # 5 + 5 + 3 tokens
    assert all("b" in s for s in chunk_steps)
    drv.decode(["b", "c"], 4)
    assert drv.reqs["b"].outputs == reference(worker, [PROMPTS["b"]], 8)[0]
    assert drv.reqs["c"].outputs == reference(worker, [PROMPTS["c"]], 5)[0]
    worker.close()


def test_async_steps_decode_the_token_the_worker_sampled(checkpoint):
    """Step N+1 is submitted before step N resolves: the scheduler cannot name the decode
    token, the worker's own token list supplies it."""
    worker = make_worker(checkpoint, stream_delay_s=0.02)
    drv = Driver(worker)
    for req_id, prompt in PROMPTS.items():
        drv.add(req_id, prompt)
    pending = [worker.execute_model(drv.build({r: len(p) for r, p in PROMPTS.items()}))]
    for _ in range(5):
        pending.append(worker.execute_model(drv.build({r: 1 for r in PROMPTS})))
    assert not pending[0].done()
    for future in pending:
        drv.record(future.result())
    assert [drv.reqs[r].outputs for r in PROMPTS] == reference(worker, list(PROMPTS.values()), 6)
    worker.close()


def test_stale_mamba_page_reused_for_attention_zeroes_new_blocks(checkpoint):
    def run(zero: bool) -> ModelRunnerOutput:
        worker = make_worker(checkpoint)
        drv = Driver(worker)
        drv.add("old", PROMPTS["a"])
        drv.step({"old": len(PROMPTS["a"])})
        page = drv.reqs["old"].blocks[-1][0]  # the Mamba slot on hybrids, a K/V page otherwise
        drv.finish("old")
        drv.free.remove(page)
        drv.free.insert(0, page)
        # Stale fp32 state whose bits read as NaN once the page holds K/V.
        for buf in worker.buffers:
            buf[page].view(torch.float32).fill_(float("nan"))
        drv.add("new", PROMPTS["b"])  # 3 tokens: the page's last slot stays unused
        out = drv.step({"new": 3}, zero=zero)
        assert drv.reqs["new"].blocks[0] == [page]
        worker.close()
        return out

    want = reference(make_worker(checkpoint), [PROMPTS["b"]], 1)[0][0]
    zeroed, stale = run(zero=True), run(zero=False)
    assert zeroed.num_zeroed_blocks == 1 and stale.num_zeroed_blocks == 0
    assert zeroed.sampled["new"] == want and math.isfinite(zeroed.logprobs["new"])
    assert math.isnan(stale.logprobs["new"])


def test_finished_requests_are_forgotten(checkpoint):
    worker = make_worker(checkpoint)
    drv = Driver(worker)
    drv.add("a", PROMPTS["a"])
    drv.add("b", PROMPTS["b"])
    drv.step({"a": 7, "b": 3})
    drv.finish("a")
    # A step that schedules nothing still drops finished requests and zeroes pages.
    idle = worker.execute_model_sync(replace(drv.build({}), new_block_ids_to_zero=[40, 41]))
    assert idle == ModelRunnerOutput(idle.step_id, {}, {}, 2)
    assert set(worker.requests) == {"b"}
    no_blocks = [[] for _ in worker.layout.groups]
    late = worker.execute_model_sync(
        SchedulerOutput(drv.step_id, [], [CachedRequestData("a", 7, no_blocks)], {"a": 1}, [], None)
    )
    assert "'a' is unknown" in late.failed_reqs["a"] and not late.sampled
    worker.close()


def test_a_bad_request_fails_alone_and_the_rest_of_the_step_runs(checkpoint):
    worker = make_worker(checkpoint)
    drv = Driver(worker)
    drv.add("b", PROMPTS["b"])
    drv.add("c", PROMPTS["c"])
    drv.step({"b": 3, "c": 13})
    want = reference(worker, [PROMPTS["c"]], 3)[0]
    bad = drv.build({"b": 2, "c": 1})  # the worker knows only one token past b's 3 computed
    result = drv.record(worker.execute_model_sync(bad))
    assert "tokens [3, 5) but the worker knows 4" in result.failed_reqs["b"]
    assert "b" not in worker.requests and "b" not in result.sampled
    drv.reqs.pop("b")
    drv.decode(["c"], 1)
    assert drv.reqs["c"].outputs == want
    with pytest.raises(ValueError, match="must be in order"):
        worker.execute_model(SchedulerOutput(0, [], [], {}, [], None))
    twice = worker.execute_model_sync(
        SchedulerOutput(drv.step_id, [NewRequestData("c", [1], GREEDY, [[0] for _ in drv.groups], 0)], [], {}, [], None)
    )
    assert "already running" in twice.failed_reqs["c"]
    worker.close()


def test_a_failed_forward_fails_that_steps_requests_only(checkpoint):
    worker = make_worker(checkpoint)
    drv = Driver(worker)
    drv.add("a", PROMPTS["a"])
    drv.step({"a": 7})
    worker.inject_faults(1)
    drv.add("b", PROMPTS["b"])
    failed = worker.execute_model_sync(drv.build({"b": 3}))
    assert set(failed.failed_reqs) == {"b"} and "injected" in failed.failed_reqs["b"]
    drv.reqs.pop("b")
    drv.decode(["a"], 2)  # "a" was not in the failed step: it goes on undisturbed
    assert drv.reqs["a"].outputs == reference(worker, [PROMPTS["a"]], 3)[0]
    worker.close()


def test_top_k_beyond_the_vocabulary_is_off(checkpoint):
    worker = make_worker(checkpoint)
    drv = Driver(worker)
    drv.add("k", PROMPTS["a"], SamplingParams(temperature=1e-4, top_k=2**31 - 1, seed=3))
    drv.step({"k": 7})
    drv.decode(["k"], 2)
    assert drv.reqs["k"].outputs == reference(worker, [PROMPTS["a"]], 3)[0]
    worker.close()


def test_resumed_request_recomputes_and_continues_identically(checkpoint):
    worker = make_worker(checkpoint, num_kv_blocks=24)
    drv = Driver(worker)
    drv.add("a", PROMPTS["a"])
    drv.step({"a": 7})
    drv.decode(["a"], 3)
    drv.preempt("a")
    # Another request takes over a's pages and overwrites them.
    drv.add("c", PROMPTS["c"])
    drv.step({"c": 13})
    drv.decode(["c"], 2)
    drv.finish("c")
    known = len(PROMPTS["a"]) + len(drv.reqs["a"].outputs)
    resumed = drv.step({"a": known})
    assert "a" in resumed.sampled
    drv.decode(["a"], 3)
    assert drv.reqs["a"].outputs == reference(worker, [PROMPTS["a"]], 8)[0]
    worker.close()


def test_narrow_kv_cache_dtype(checkpoint):
    worker = make_worker(checkpoint, kv_cache_dtype="bfloat16")
    assert worker.layout.attn_dtype == "bfloat16"
    assert worker.layout.device == "cpu"  # what the engine sizes a prefill step by
    drv = Driver(worker)
    drv.add("a", PROMPTS["a"])
    drv.step({"a": 7})
    drv.decode(["a"], 2)
    assert len(drv.reqs["a"].outputs) == 3
    assert math.isfinite(drv.step({"a": 1}).logprobs["a"])
    worker.close()


def test_the_auto_device_is_resolved_by_the_worker(checkpoint):
    """The engine passes `auto` on (it does not load torch); the worker picks its own device."""
    worker = make_worker(checkpoint, device="auto")
    assert worker.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    worker.close()


def test_without_the_cpu_kernels_the_torch_path_gives_the_same_tokens(checkpoint, caplog):
    """`--no-cpu-kernels` reaches the worker, which then runs the torch path, greedy-equal, and
    says which kernels it runs in its start-up log."""
    caplog.set_level(logging.INFO, logger="worker.worker")
    outputs = {}
    for on in (True, False):
        with cpu_kernels.using():  # each worker installs its own choice; the process's comes back after
            worker = make_worker(checkpoint, cpu_kernels=on)
            assert worker.kernels.on is on and cpu_kernels.usable(torch.zeros(1)) is on
            assert cpu_kernels.summary(worker.kernels, []).split(";")[0] in caplog.text
            drv = Driver(worker)
            for req_id, prompt in PROMPTS.items():
                drv.add(req_id, prompt)
            drv.step({r: len(p) for r, p in PROMPTS.items()})
            drv.decode(list(PROMPTS), 9)
            outputs[on] = [drv.reqs[r].outputs for r in PROMPTS]
            worker.close()
    assert outputs[True] == outputs[False]


def test_the_model_and_caches_are_built_on_the_stream_thread(checkpoint, monkeypatch):
    """Start-up's parallel work (loading and packing the weights, zeroing the caches) runs on the
    compute stream's thread, whose OpenMP threads run the steps: done on the constructing
    thread it left a second team of OpenMP threads, more of them than CPUs, and libgomp then
    let its threads sleep between regions, so each parallel call of a step woke one."""
    import worker.worker as module

    seen: dict[str, threading.Thread] = {}

    def spy(name: str):
        real = getattr(module, name)

        def call(*args, **kw):
            seen[name] = threading.current_thread()
            return real(*args, **kw)

        return call

    for name in ("load_model", "allocate_caches"):
        monkeypatch.setattr(module, name, spy(name))
    worker = make_worker(checkpoint)
    stream_thread = worker._stream.submit(threading.current_thread).result()
    assert stream_thread is not threading.current_thread()
    assert seen == {"load_model": stream_thread, "allocate_caches": stream_thread}
    worker.close()
