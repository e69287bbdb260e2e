"""A worker: the model, its cache memory and the token history of every running request.

Each `SchedulerOutput` becomes one job on the worker's compute stream: apply the request
updates, zero the step's new attention pages, run the forward, sample.

Fault isolation: a request the worker cannot run (an update that contradicts what it knows,
a load it cannot post, a sampling failure) is dropped and reported in `failed_reqs`; if the
forward itself fails, every request of that step fails, and only those. The engine goes on. Keeping all of it
in one job keeps the order docs/design.md §1 depends on: a step's zeroing runs after the
previous step's forward and before its own. The worker's token lists are the truth for
what a step computes: under async scheduling a decode step names a token the previous
step is still sampling, which only the worker knows.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.messages import (
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    TopLogprobs,
)
from kernels.cpu import ops as cpu_kernels
from kv.cache_buffers import allocate_caches
from kv.cache_layout import CacheLayout, auto_block_size, plan_layout
from kv.nixl.compat import kv_compat
from kv.nixl.tp_slices import PageSlicer, read_pieces
from kv.nixl.transfer_stats import TransferStats
from kv.nixl.verify import HandOverChecksums, algorithm
from kv.nixl.worker import NixlWorkerConnector
from models.batch import ForwardBatch, SeqChunk, build_forward_batch
from models.config import ModelConfig
from models.dtypes import DTYPE_BYTES, dtype_name
from models.layers import panel_fallbacks
from models.loader import checkpoint_bytes, load_model
from models.model_files import load_config, load_generation_config
from models.tensor_parallel import init_tp_group
from worker.compute_stream import ComputeStream
from worker.config import WorkerConfig
from worker.sampler import Sampler, TokenHistory, logprobs_of
from worker.structured import StructuredOutputs, failure
from worker.token_counts import TokenCounts

if TYPE_CHECKING:
    from worker.grammar_mask import RequestGrammar  # imports xgrammar: only once a request has a grammar

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` is resolved here, on the worker's node: the engine that configured the worker may
    sit on a node without the worker's GPU, and does not load torch (docs/design.md §14)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def parse_dtype(name: str) -> str | None:
    """None for 'auto' (the checkpoint's dtype for weights, the weights' dtype for the cache)."""
    if name == "auto":
        return None
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {name!r}; use 'auto' or one of {sorted(DTYPE_BYTES)}")
    return name


# A sampled row: (row, token, its logprob, its alternatives), the last two when asked for.
_Sampled = tuple[int, int, float | None, TopLogprobs | None]


@dataclass(slots=True)
class _StepLogprobs:
    """The logprobs a step computed, by request, for its `ModelRunnerOutput`."""

    sampled: dict[str, float] = field(default_factory=dict)
    top: dict[str, TopLogprobs] = field(default_factory=dict)
    prompt: dict[str, Logprobs] = field(default_factory=dict)


@dataclass(slots=True)
class RequestState:
    tokens: list[int]  # prompt + every token this worker sampled
    block_ids: list[list[int]]  # one list per cache group
    sampling: SamplingParams
    generator: torch.Generator | None
    num_computed: int  # tokens whose KV / state is in the cache
    num_prompt: int  # tokens before its outputs (a resumed request's earlier outputs are outputs)
    scored_tail: tuple[int, ...] = ()  # see NewRequestData.scored_tail
    grammar: RequestGrammar | None = None  # its matcher, with a structured output (worker/grammar_mask.py)


def rank_agent_name(agent_name: str, rank: int) -> str:
    """Rank `rank`'s NIXL agent. Rank 0's is the engine's own name: the one KVTransferParams
    carry, from which a reader finds the other ranks."""
    return agent_name if rank == 0 else f"{agent_name}-tp{rank}"


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.device = resolve_device(cfg.device)
        self._stream = ComputeStream(self.device, cfg.stream_delay_s, cfg.cpus)
        # What torch builds with its threads (the weights, their packing, the caches) is built on
        # the stream's thread, whose OpenMP threads then run every step. A parallel region run
        # by the constructing thread would leave a second team of OpenMP threads behind, and
        # with more of them than CPUs libgomp stops spinning between regions: each of a step's
        # parallel calls then woke a sleeping thread (docs/design.md §13).
        try:
            self._stream.submit(self._build, cfg).result()
        except BaseException:
            self._stream.close()
            raise
        # Touched only by jobs on the stream; read it between steps, never during one.
        self.requests: dict[str, RequestState] = {}
        self._last_step: int | None = None
        # Disaggregated roles register the cache with NIXL: a prefill worker is read from, a
        # decode worker reads. Made here, so that the agent's threads are not bound to the
        # stream's CPUs.
        self.connector = (
            None
            if cfg.kv_role == "colocated"
            else NixlWorkerConnector(
                cfg.engine_id,
                self.buffers,
                self._layout.page_bytes,
                self._layout.num_blocks,
                agent_name=rank_agent_name(cfg.nixl_agent_name, cfg.tp_rank) if cfg.nixl_agent_name else None,
                fail_fraction=cfg.kv_fail_fraction,
                fail_seed=cfg.seed + cfg.tp_rank,  # ranks fail apart: a load may fail on one rank only
                transfer_timeout_s=cfg.kv_transfer_timeout_s,
                delay_s=cfg.kv_delay_s,
                compat=kv_compat(
                    cfg.model_dir, self._layout, algorithm(self.device) if cfg.kv_verify else "", self.tp.size
                ),
                corrupt_fraction=cfg.kv_corrupt_fraction,
                slicer=PageSlicer(
                    self.full_config,
                    self._layout.block_size,
                    self._layout.attn_dtype,
                    self.tp.rank,
                    self.tp.size,
                    tuple(g.kind for g in self._layout.groups),
                ),
            )
        )
        self._faults_to_inject = 0
        self._hand_over_sums = (
            self._checksummer(cfg, self._layout.attn_dtype) if cfg.kv_verify and cfg.kv_role == "prefill" else None
        )

    def _build(self, cfg: WorkerConfig) -> None:
        """The model, its caches, the sampler's state: the stream's first job."""
        self.full_config = load_config(cfg.model_dir)
        weights = parse_dtype(cfg.dtype)
        if weights is None and self.device.type == "cpu" and DTYPE_BYTES[self.full_config.dtype] < 4:
            weights = "float32"  # half-precision matmuls run several times slower than fp32 on CPUs
        # Decided once, before the model is packed (its Linears take their panels by it), for
        # the weights this rank will hold.
        stored = DTYPE_BYTES[self.full_config.dtype]
        held = checkpoint_bytes(cfg.model_dir) * DTYPE_BYTES[weights or self.full_config.dtype] // stored // cfg.tp_size
        self.kernels = cpu_kernels.install(
            cpu_kernels.decide(cfg.cpu_kernels, self.device, cfg.cpu_vectors, weight_bytes=held)
        )
        self.tp = init_tp_group(cfg.tp_rank, cfg.tp_size, cfg.tp_init_method, self.device)
        loaded = load_model(
            cfg.model_dir, dtype=getattr(torch, weights) if weights else None, device=self.device, tp=self.tp
        )
        self.model = loaded.model
        log.info("%s", cpu_kernels.summary(self.kernels, panel_fallbacks(self.model)))
        self.config: ModelConfig = loaded.config  # this rank's share under tensor parallelism
        cache_dtype = parse_dtype(cfg.kv_cache_dtype) or dtype_name(next(self.model.parameters()).dtype)
        block_size = cfg.block_size or auto_block_size(self.full_config, cache_dtype)
        planned = plan_layout(self.config, cache_dtype, block_size, cfg.num_kv_blocks, cfg.kv_cache_memory)
        self._layout = dataclasses.replace(planned, device=self.device.type)
        # Zeroed once here; afterwards a page keeps what its last owner left (see allocate_caches).
        self.buffers, self.caches = allocate_caches(self._layout, self.config, self.device)
        self.sampler = Sampler(cfg.seed, self.device, self.config.vocab_size)
        self.eos_token_id = load_generation_config(cfg.model_dir, self.full_config)[1]  # what min_tokens masks
        self.token_counts = TokenCounts(self.config.vocab_size, self.device)
        self.structured = StructuredOutputs(cfg.model_dir, self.config.vocab_size, self.eos_token_id)

    def inject_faults(self, num_steps: int) -> None:
        """Tests only (reached through Ray, never over HTTP): the next `num_steps` forwards
        raise, as a device fault would."""
        self._faults_to_inject = num_steps

    @property
    def layout(self) -> CacheLayout:
        return self._layout

    def execute_model(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Queue the step on the compute stream; steps must come in increasing step_id order,
        since each one builds on the token lists the previous one left."""
        if self._last_step is not None and out.step_id <= self._last_step:
            raise ValueError(f"step {out.step_id} submitted after step {self._last_step}: steps must be in order")
        self._last_step = out.step_id
        self._start_transfers(out)
        self.structured.prefetch(out.new_reqs)  # compiles while the step in flight runs
        return self._stream.submit(self._step, out)

    def _start_transfers(self, out: SchedulerOutput) -> None:
        """Post the step's KV loads now, not on the compute stream: they complete on UCX's own
        progress, possibly before this step's zeroing (queued behind the forward in flight)
        runs. That is the race the scheduler's skip set exists for."""
        meta = out.kv_connector_meta
        if meta is None:
            return
        if self.connector is None:
            raise ValueError(f"step {out.step_id} carries KV transfers but this worker has no connector")
        for agent, req_id in meta.notify:
            self.connector.send_notif(agent, req_id)
        for load in meta.loads:
            self.connector.start_load(load.req_id, load.params, load.block_ids)

    def with_finished_transfers(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """Add the transfers that ended since the last step to a step's result."""
        if self.connector is None:
            return result
        done = self.connector.get_finished()
        return dataclasses.replace(
            result,
            finished_sending=sorted(done.done_sending),
            finished_recving=sorted(done.done_recving),
            failed_loads=done.failed,
        )

    def transfer_stats(self) -> TransferStats | None:
        """The connector's KV-load counters; None for a colocated worker."""
        return None if self.connector is None else self.connector.transfer_stats()

    def execute_model_sync(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model(out).result()

    def close(self) -> None:
        self._stream.close()
        self.structured.close()
        if self.connector is not None:
            self.connector.close()
        if self.tp.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    @torch.inference_mode()
    def _step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        failed = self._apply(out)
        zeroed = self._zero(out.new_block_ids_to_zero or [])
        self._copy_pages(out.state_restores)
        scheduled = {r: n for r, n in out.num_scheduled_tokens.items() if r not in failed}
        sampled: dict[str, int] = {}
        logprobs = _StepLogprobs()
        if scheduled:
            try:
                if self._faults_to_inject > 0:
                    self._faults_to_inject -= 1
                    raise RuntimeError("injected worker fault")
                sampled = self._forward(scheduled, failed, logprobs)
            except Exception as e:  # the step's requests fail; the engine and its other requests go on
                log.exception("worker step %d failed", out.step_id)
                for req_id in scheduled:
                    self._drop(failed, req_id, f"the worker failed step {out.step_id}: {e!r}")
        self._copy_pages(out.state_saves)
        # A request sampled on the prefill side has its prompt computed and is handed over;
        # nothing writes its blocks afterwards, so their checksums hold until it is read.
        sums = self._hand_over_sums
        checksums = {} if sums is None else {r: [sums.table(self.requests[r].block_ids)] for r in sampled}
        return ModelRunnerOutput(
            out.step_id,
            sampled,
            logprobs.sampled,
            zeroed,
            failed_reqs=failed,
            kv_checksums=checksums,
            top_logprobs=logprobs.top,
            prompt_logprobs=logprobs.prompt,
        )

    def _checksummer(self, cfg: WorkerConfig, cache_dtype: str) -> HandOverChecksums:
        """--kv-verify on a prefill rank: per decode rank (of `kv_verify_tp`), the spans of
        this rank's pages that decode rank READs."""
        kinds = tuple(g.kind for g in self._layout.groups)
        readers = PageSlicer(self.full_config, self._layout.block_size, cache_dtype, 0, cfg.kv_verify_tp, kinds)
        page = self._layout.page_bytes
        spans = [
            [
                [
                    (p.remote, p.length)
                    for p in read_pieces(readers, kind, self.tp.rank, self.tp.size, d, readers.size, page)
                ]
                for kind in kinds
            ]
            for d in range(readers.size)
        ]
        return HandOverChecksums(self.buffers, spans)

    def _forward(self, scheduled: dict[str, int], failed: dict[str, str], logprobs: _StepLogprobs) -> dict[str, int]:
        """Run the scheduled chunks, then sample for each request whose chunk reached its last
        known token; an intermediate prefill chunk has no next token to sample. A chunk of a
        request that asks for prompt logprobs gets logits for every one of its positions."""
        ids = list(scheduled)
        chunks = [self._chunk(req_id, scheduled[req_id]) for req_id in ids]
        batch = build_forward_batch(chunks, self._layout.groups, self._layout.block_size, self.device)
        scored = [self._num_scored(req_id, chunk) for req_id, chunk in zip(ids, chunks)]
        last: list[int] | None = None
        if any(scored):
            batch, last = self._all_logits(batch, scored)
        logits = self.model(batch, self.caches)
        if last is not None:
            self._prompt_logprobs(logits, ids, chunks, scored, last, logprobs)
            logits = logits[last]
        rows: list[int] = []
        for r, (req_id, chunk) in enumerate(zip(ids, chunks)):
            state = self.requests[req_id]
            state.num_computed += len(chunk.token_ids)
            if state.num_computed == len(state.tokens):
                rows.append(r)
        sampled: dict[str, int] = {}
        for r, token, logprob, top in self._sample(logits, [ids[r] for r in rows], rows, failed):
            state = self.requests[ids[r]]
            if state.grammar is not None and not state.grammar.accept(token):
                self._drop(failed, ids[r], f"sampled token {token}, which its grammar does not allow")
                continue
            state.tokens.append(token)
            sampled[ids[r]] = token
            if logprob is not None:
                logprobs.sampled[ids[r]] = logprob
            if top is not None:
                logprobs.top[ids[r]] = top
        self.token_counts.record(list(sampled), list(sampled.values()))
        return sampled

    def _num_scored(self, req_id: str, chunk: SeqChunk) -> int:
        """The prompt tokens this chunk's positions score for prompt logprobs: position p
        scores token p + 1 of the prompt (and of the scored tail)."""
        state = self.requests[req_id]
        if state.sampling.prompt_logprobs is None:
            return 0
        end = min(chunk.num_computed + len(chunk.token_ids), state.num_prompt + len(state.scored_tail) - 1)
        return max(0, end - chunk.num_computed)

    def _all_logits(self, batch: ForwardBatch, scored: list[int]) -> tuple[ForwardBatch, list[int]]:
        """The batch with logits for every position of the chunks that score prompt tokens,
        and where each request's last row (the one it samples from) lands among them."""
        index: list[int] = []
        last: list[int] = []
        starts = batch.query_start
        for r, n in enumerate(scored):
            index.extend(range(starts[r], starts[r + 1]) if n else (starts[r + 1] - 1,))
            last.append(len(index) - 1)
        indices = torch.tensor(index, dtype=torch.long, device=self.device)
        return dataclasses.replace(batch, logits_indices=indices), last

    def _prompt_logprobs(
        self,
        logits: torch.Tensor,
        ids: list[str],
        chunks: list[SeqChunk],
        scored: list[int],
        last: list[int],
        logprobs: _StepLogprobs,
    ) -> None:
        for r, n in enumerate(scored):
            if not n:
                continue
            state = self.requests[ids[r]]
            start = chunks[r].num_computed
            first = last[r] + 1 - len(chunks[r].token_ids)
            known = state.tokens[: state.num_prompt] + list(state.scored_tail)
            targets = torch.tensor(known[start + 1 : start + 1 + n], dtype=torch.long, device=self.device)
            top_n = state.sampling.prompt_logprobs or 0
            values, top = logprobs_of(logits[first : first + n], targets, top_n)
            logprobs.prompt[ids[r]] = Logprobs(start + 1, values, top)

    def _sample(
        self, logits: torch.Tensor, req_ids: list[str], rows: list[int], failed: dict[str, str]
    ) -> list[_Sampled]:
        """(row, token, logprob, alternatives) per sampled row. If the batch cannot be sampled,
        each row is sampled alone so that one bad request fails without the others."""
        if not rows:
            return []
        try:
            return self._sample_rows(logits, req_ids, rows)
        except Exception:
            log.exception("batched sampling failed; sampling row by row")
        results = []
        for req_id, r in zip(req_ids, rows):
            try:
                results += self._sample_rows(logits, [req_id], [r])
            except Exception as e:
                self._drop(failed, req_id, f"sampling failed: {e!r}")
        return results

    def _sample_rows(self, logits: torch.Tensor, req_ids: list[str], rows: list[int]) -> list[_Sampled]:
        states = [self.requests[r] for r in req_ids]
        params = [s.sampling for s in states]
        want = [p.logprobs for p in params]
        history = None
        if any(p.adjusts_logits for p in params):
            counts = prompt_mask = None
            if any(p.penalized for p in params):
                counts, prompt_mask = self.token_counts.gather(req_ids)
            outputs = [len(s.tokens) - s.num_prompt for s in states]
            history = TokenHistory(counts, prompt_mask, outputs, self.eos_token_id)
        logits = logits[rows]  # a copy: the rows are masked in place
        self.structured.mask(logits, [s.grammar for s in states])
        result = self.sampler.sample(
            logits, params, [s.generator for s in states], want_logprobs=any(want), history=history
        )
        top = result.top_logprobs
        return [
            (
                r,
                result.token_ids[i],
                result.logprobs[i] if want[i] and result.logprobs is not None else None,
                top[i][: params[i].top_logprobs] if want[i] and top is not None and params[i].top_logprobs else None,
            )
            for i, r in enumerate(rows)
        ]

    def _drop(self, failed: dict[str, str], req_id: str, why: str) -> None:
        failed[req_id] = why
        self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.token_counts.remove(req_id)

    def _apply(self, out: SchedulerOutput) -> dict[str, str]:
        """Check the request updates against what the worker knows, then apply the good ones.
        Returns the requests that cannot run, with why; they are forgotten here."""
        failed = self._check(out)
        for req_id in out.finished_req_ids:
            self._forget(req_id)  # a request may finish before it ever reached a worker
        for req_id, why in failed.items():
            self._drop(failed, req_id, why)
        for new in out.new_reqs:
            if new.req_id not in failed:
                try:
                    self.requests[new.req_id] = self._new_state(new)
                except Exception as e:  # its grammar: a schema that does not compile fails it alone
                    self._drop(failed, new.req_id, failure(e))
        for cached in out.cached_reqs:
            if cached.req_id in failed:
                continue
            state = self.requests[cached.req_id]
            state.num_computed = cached.num_computed_tokens
            if cached.resumed:
                state.block_ids = [list(ids) for ids in cached.new_block_ids]
            else:
                for ids, more in zip(state.block_ids, cached.new_block_ids):
                    ids.extend(more)
        return failed

    def _check(self, out: SchedulerOutput) -> dict[str, str]:
        """The requests of this step that contradict what the worker knows, with why (a cached
        request not listed in `cached_reqs` continues from the worker's own count). A bad zero
        list is no single request's fault: it raises."""
        step = f"step {out.step_id}"
        bad_zero = [b for b in out.new_block_ids_to_zero or [] if not 0 <= b < self._layout.num_blocks]
        if bad_zero:
            raise ValueError(f"{step}: blocks to zero {bad_zero} outside [0, {self._layout.num_blocks})")
        bad_copy = [
            p for p in out.state_restores + out.state_saves if not all(0 <= b < self._layout.num_blocks for b in p)
        ]
        if bad_copy:
            raise ValueError(f"{step}: state page copies {bad_copy} outside [0, {self._layout.num_blocks})")
        failed: dict[str, str] = {}
        # (tokens known, tokens computed) of every request this step may name, after its updates
        span = {
            req_id: (len(s.tokens), s.num_computed)
            for req_id, s in self.requests.items()
            if req_id not in out.finished_req_ids
        }
        for new in out.new_reqs:
            if new.req_id in span:
                failed[new.req_id] = f"{step}: new request {new.req_id!r} is already running"
                continue
            if why := self._check_blocks(step, new.req_id, new.block_ids):
                failed[new.req_id] = why
            span[new.req_id] = (len(new.prompt_token_ids), new.num_computed_tokens)
        for cached in out.cached_reqs:
            if cached.req_id not in span:
                failed[cached.req_id] = (
                    f"{step}: cached request {cached.req_id!r} is unknown to the worker "
                    "(never sent as new, or already failed)"
                )
                continue
            if why := self._check_blocks(step, cached.req_id, cached.new_block_ids):
                failed[cached.req_id] = why
            span[cached.req_id] = (span[cached.req_id][0], cached.num_computed_tokens)
        for req_id, n in out.num_scheduled_tokens.items():
            if req_id in failed:
                continue
            if req_id not in span:
                failed[req_id] = f"{step}: scheduled request {req_id!r} is unknown to the worker"
                continue
            known, computed = span[req_id]
            if n < 1 or computed < 0 or computed + n > known:
                failed[req_id] = (
                    f"{step}: request {req_id!r} is scheduled tokens [{computed}, {computed + n}) but "
                    f"the worker knows {known} (was the previous step's token sampled elsewhere?)"
                )
        return failed

    def _new_state(self, new: NewRequestData) -> RequestState:
        params = new.sampling
        num_prompt = len(new.prompt_token_ids) - params.num_prior_outputs
        if params.penalized:
            prompt = new.prompt_token_ids
            self.token_counts.add(new.req_id, prompt, prompt[num_prompt:] if params.num_prior_outputs else ())
        return RequestState(
            list(new.prompt_token_ids),
            [list(ids) for ids in new.block_ids],
            params,
            self.sampler.generator_for(params),
            new.num_computed_tokens,
            num_prompt,
            new.scored_tail,
            self.structured.matcher(new, num_prompt),
        )

    def _check_blocks(self, step: str, req_id: str, block_ids: list[list[int]]) -> str | None:
        if len(block_ids) != len(self._layout.groups):
            return (
                f"{step}: request {req_id!r} has block ids for {len(block_ids)} groups, "
                f"the model has {len(self._layout.groups)}"
            )
        bad = [b for ids in block_ids for b in ids if not 0 <= b < self._layout.num_blocks]
        if bad:
            return f"{step}: request {req_id!r} names blocks {bad} outside [0, {self._layout.num_blocks})"
        return None

    def _zero(self, block_ids: list[int]) -> int:
        """On the host page by page: each page is one run of bytes, and `zero_` on it is a
        memset, where one indexed fill of them all (`buf[ids] = 0`) ran 1.6-3x slower (8-32
        pages of 32 KiB to 1 MiB). On a GPU the indexed fill is one kernel launch, not one a page."""
        if self.device.type == "cpu":
            for buf in self.buffers:
                for block in block_ids:
                    buf[block].zero_()
        elif block_ids:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            for buf in self.buffers:
                buf[index] = 0
        return len(block_ids)

    def _copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """State checkpoints (docs/design.md §21): page `src` copied whole onto page `dst` in
        every buffer, on the stream, so a save sees its step's forward and a restore comes
        after the save it reads. Under TP each rank copies its own heads' pages."""
        for src, dst in pairs:
            for buf in self.buffers:
                buf[dst].copy_(buf[src])

    def _chunk(self, req_id: str, n: int) -> SeqChunk:
        state = self.requests[req_id]
        start = state.num_computed
        return SeqChunk(state.tokens[start : start + n], start, state.block_ids)
