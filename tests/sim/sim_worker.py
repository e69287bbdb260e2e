"""A content-tracking stand-in for `worker.worker.Worker` (same duck type: `execute_model`
returning a future of `ModelRunnerOutput`, and `with_finished_transfers`).

Each step becomes a job on a simulated compute stream that runs the jobs in order, each after
a seeded random lag: apply the request updates (as `Worker._apply`, with its checks), zero
the step's `new_block_ids_to_zero`, then the forward (tests/sim/forward.py), which checks every
K/V entry and state it reads against the token history and samples a token that is a function
of that history, or a wrong one after a bad read. KV loads and notifications are posted at
`execute_model` time, outside the stream, exactly where the real worker posts them.

Under tensor parallelism an engine has one SimWorker per rank (tests/sim/ranks.py), each
holding the pages of its own heads only; every rank gets every step (zero list included),
checks what its heads hold, and its forward meets the other ranks' in an all-reduce, so a
wrong page on one rank gives every rank the same wrong token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine.messages import ModelRunnerOutput, SchedulerOutput
from kv.cache_group import CacheGroup, cdiv
from tests.engine.fake_worker import VOCAB, next_token
from tests.sim.content import PageMemory, Provenance, extend_prefix_hashes
from tests.sim.fabric import Fabric, SimConnector
from tests.sim.forward import BadRead, ChunkContext, run_chunk
from tests.sim.ranks import Collective, heads_of


@dataclass(slots=True)
class _ReqState:
    tokens: list[int]
    hashes: list[int]
    block_ids: list[list[int]]
    num_computed: int


class SimWorker:
    def __init__(
        self,
        engine_id: str,
        groups: tuple[CacheGroup, ...],
        num_blocks: int,
        block_size: int,
        prov: Provenance,
        rng: random.Random,
        lag_s: tuple[float, float],
        fabric: Fabric | None = None,
        rank: int = 0,
        collective: Collective | None = None,
    ) -> None:
        """`collective` joins the ranks of one engine (its size is the TP size)."""
        self.engine_id = engine_id
        self.groups = groups
        self.collective = collective or Collective(1)
        self.rank, tp = rank, self.collective.size
        self.name = engine_id if tp == 1 else f"{engine_id}/rank{rank}"
        self.num_blocks, self.block_size = num_blocks, block_size
        self.memories = {h: PageMemory(num_blocks, block_size) for h in heads_of(rank, tp)}
        self.prov = prov
        self.rng = rng
        self.lag_s = lag_s  # each job waits this long (uniform) before it runs: the stream lags
        self.requests: dict[str, _ReqState] = {}
        self.bad_reads: list[BadRead] = []
        self.steps_run = 0
        self.pages_copied = 0
        self._last_step: int | None = None
        self._queue: asyncio.Queue[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = asyncio.Queue()
        self._stream: asyncio.Task[None] | None = None
        self.connector: SimConnector | None = (
            fabric.connect(engine_id, rank, tp, self.memories, lambda: self.steps_run) if fabric is not None else None
        )

    @property
    def agent_name(self) -> str:
        return self.connector.agent_name if self.connector is not None else ""

    def execute_model(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._last_step is not None and out.step_id <= self._last_step:
            raise ValueError(f"step {out.step_id} submitted after step {self._last_step}: steps must be in order")
        self._last_step = out.step_id
        self._start_transfers(out)
        fut: Future[ModelRunnerOutput] = Future()
        self._queue.put_nowait((out, fut))
        if self._stream is None:
            self._stream = asyncio.get_running_loop().create_task(self._run_stream())
        return fut

    def held(self) -> dict[str, int]:
        """As `WorkerActor.held`: what this rank still holds, each zero once the engine is idle."""
        return {"requests": len(self.requests), **(self.connector.held() if self.connector is not None else {})}

    def with_finished_transfers(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        if self.connector is None:
            return result
        done = self.connector.get_finished()
        return dataclasses.replace(
            result,
            finished_sending=sorted(done.sending),
            finished_recving=sorted(done.recving),
            failed_loads={r: done.failed[r] for r in sorted(done.failed)},
        )

    def executor(self) -> Callable[[SchedulerOutput], Awaitable[ModelRunnerOutput]]:
        """The engine's `StepExecutor`: submit now (so steps reach the stream in order),
        collect the result and the finished transfers later, as the worker actor does."""

        def run(out: SchedulerOutput) -> Awaitable[ModelRunnerOutput]:
            fut = self.execute_model(out)

            async def result() -> ModelRunnerOutput:
                return self.with_finished_transfers(await asyncio.wrap_future(fut))

            return result()

        return run

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            await asyncio.gather(self._stream, return_exceptions=True)

    def _start_transfers(self, out: SchedulerOutput) -> None:
        meta = out.kv_connector_meta
        if meta is None:
            return
        if self.connector is None:
            raise ValueError(f"step {out.step_id} carries KV transfers but this worker has no connector")
        for agent, req_id in meta.notify:
            self.connector.send_notif(agent, req_id)
        for load in meta.loads:
            self.connector.start_load(load.req_id, load.params, load.block_ids, out.step_id)

    async def _run_stream(self) -> None:
        while True:
            out, fut = await self._queue.get()
            await asyncio.sleep(self.rng.uniform(*self.lag_s))
            try:
                fut.set_result(await self._step(out))
            except Exception as e:  # the engine sees a failed step, as with the real worker
                fut.set_exception(e)
            self.steps_run = out.step_id + 1

    async def _step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """As `Worker._step`: a request the worker cannot run fails alone (`failed_reqs`); a
        forward that cannot run fails every request of the step; a bad zero list raises."""
        bad_zero = [b for b in out.new_block_ids_to_zero or [] if not 0 <= b < self.num_blocks]
        if bad_zero:
            raise ValueError(f"step {out.step_id}: blocks to zero {bad_zero} outside [0, {self.num_blocks})")
        failed = self._apply(out)
        for block in out.new_block_ids_to_zero or []:
            for memory in self.memories.values():
                memory.zero(block)
        zeroed = len(out.new_block_ids_to_zero or [])
        self._copy_pages(out.state_restores)
        scheduled = {r: n for r, n in out.num_scheduled_tokens.items() if r not in failed}
        sampled: dict[str, int] = {}
        try:
            chunks = [self._chunk(out.step_id, req_id, n) for req_id, n in scheduled.items()]
        except ValueError as e:  # the real batch builder refuses the whole step
            for req_id in scheduled:
                self._drop(failed, req_id, f"the worker failed step {out.step_id}: {e!r}")
            self._copy_pages(out.state_saves)
            return ModelRunnerOutput(out.step_id, {}, num_zeroed_blocks=zeroed, failed_reqs=failed)
        read_wrong = {ctx.req_id for ctx, start, end in chunks if self._forward(ctx, start, end)}
        self._copy_pages(out.state_saves)
        if chunks:  # every rank has the same chunks: all of them meet here, or none
            read_wrong = await self.collective.all_reduce(out.step_id, read_wrong)
        for ctx, _, end in chunks:
            token = self._sample(ctx.req_id, end, ctx.req_id in read_wrong)
            if token is not None:
                sampled[ctx.req_id] = token
        return ModelRunnerOutput(out.step_id, sampled, num_zeroed_blocks=zeroed, failed_reqs=failed)

    def _copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """As `Worker._copy_pages`: state checkpoints saved and restored whole, on the stream; a
        copied state keeps the prefix it was computed from, so a forward that starts from a
        checkpoint of another prefix or length is a bad read."""
        for src, dst in pairs:
            for memory in self.memories.values():
                memory.copy_page(memory, src, dst)
        self.pages_copied += len(pairs)

    def _chunk(self, step: int, req_id: str, n: int) -> tuple[ChunkContext, int, int]:
        state = self.requests[req_id]
        start, end = state.num_computed, state.num_computed + n
        for g, group in enumerate(self.groups):
            need = cdiv(end, self.block_size) if group.kind == "attention" else 1
            if len(state.block_ids[g]) < need:
                raise ValueError(f"request {req_id!r} has {len(state.block_ids[g])} blocks in group {g}, needs {need}")
        extend_prefix_hashes(state.hashes, state.tokens)
        return ChunkContext(self.name, step, req_id, state.tokens, state.hashes, state.block_ids), start, end

    def _forward(self, ctx: ChunkContext, start: int, end: int) -> bool:
        """Check and write one request's chunk on every head this rank holds; whether it
        read anything wrong."""
        bad = [
            b for memory in self.memories.values() for b in run_chunk(memory, self.prov, self.groups, ctx, start, end)
        ]
        self.bad_reads.extend(bad)
        self.requests[ctx.req_id].num_computed = end
        return bool(bad)

    def _sample(self, req_id: str, end: int, read_wrong: bool) -> int | None:
        """The token after the chunk ending at `end`, or None mid-prompt."""
        state = self.requests[req_id]
        if end < len(state.tokens):
            return None  # an intermediate prefill chunk samples nothing
        token = next_token(state.tokens)
        if read_wrong:
            token = (token + 1) % VOCAB  # computed from wrong content (on some rank): a wrong token
        state.tokens.append(token)
        return token

    def _apply(self, out: SchedulerOutput) -> dict[str, str]:
        """As `Worker._apply`: requests whose update contradicts what the worker knows are
        dropped and returned with why; the others are applied."""
        failed = self._check(out)
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id, why in list(failed.items()):
            self._drop(failed, req_id, why)
        for new in out.new_reqs:
            if new.req_id not in failed:
                self.requests[new.req_id] = _ReqState(
                    list(new.prompt_token_ids), [], [list(b) for b in new.block_ids], new.num_computed_tokens
                )
        for cached in out.cached_reqs:
            if cached.req_id in failed:
                continue
            state = self.requests[cached.req_id]
            state.num_computed = cached.num_computed_tokens
            if cached.resumed:
                state.block_ids = [list(b) for b in cached.new_block_ids]
            else:
                for mine, more in zip(state.block_ids, cached.new_block_ids, strict=True):
                    mine.extend(more)
        return failed

    def _check(self, out: SchedulerOutput) -> dict[str, str]:
        step = f"step {out.step_id}"
        failed: dict[str, str] = {}
        span = {r: (len(s.tokens), s.num_computed) for r, s in self.requests.items() if r not in out.finished_req_ids}
        for new in out.new_reqs:
            if new.req_id in span:
                failed[new.req_id] = f"{step}: new request {new.req_id!r} is already running"
                continue
            if why := self._check_blocks(step, new.req_id, new.block_ids):
                failed[new.req_id] = why
            span[new.req_id] = (len(new.prompt_token_ids), new.num_computed_tokens)
        for cached in out.cached_reqs:
            if cached.req_id not in span:
                failed[cached.req_id] = f"{step}: cached request {cached.req_id!r} is unknown to the worker"
                continue
            if why := self._check_blocks(step, cached.req_id, cached.new_block_ids):
                failed[cached.req_id] = why
            span[cached.req_id] = (span[cached.req_id][0], cached.num_computed_tokens)
        for req_id, n in out.num_scheduled_tokens.items():
            if req_id in failed:
                continue
            if req_id not in span:
                failed[req_id] = f"{step}: scheduled request {req_id!r} is unknown to the worker"
            elif n < 1 or span[req_id][1] + n > span[req_id][0]:
                failed[req_id] = (
                    f"{step}: request {req_id!r} is scheduled tokens [{span[req_id][1]}, "
                    f"{span[req_id][1] + n}) but the worker knows {span[req_id][0]}"
                )
        return failed

    def _check_blocks(self, step: str, req_id: str, block_ids: list[list[int]]) -> str | None:
        if len(block_ids) != len(self.groups):
            return f"{step}: request {req_id!r} has block ids for {len(block_ids)} groups"
        bad = [b for ids in block_ids for b in ids if not 0 <= b < self.num_blocks]
        return f"{step}: request {req_id!r} names blocks {bad} outside the cache" if bad else None

    def _drop(self, failed: dict[str, str], req_id: str, why: str) -> None:
        failed[req_id] = why
        self.requests.pop(req_id, None)
