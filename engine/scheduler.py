"""The step scheduler: which tokens of which requests run next, in which blocks.

Running requests are served first (decode and unfinished prefill), then waiting ones, within
a token budget and a cap on running requests; a prompt longer than the budget is prefilled
in chunks. When blocks run out the lowest-priority running request is preempted and later
recomputed. Under async scheduling step N+1 is scheduled while step N runs: a request whose
step N will sample a token carries a placeholder for it, so its next decode step can be
scheduled before the token is known (the workers know it by then).

Two fences keep memory safe under that overlap (docs/design.md §3):
- freed blocks go back to the pool only once the last step that used them has reported;
- a preempted request is not resumed before that either.

Disaggregated serving (a `DisaggConfig`) adds one component, `self.pd` (engine/pd.py), and
the fix this project exists for: a decode request whose prompt KV arrives by NIXL READ gets
its blocks allocated, the attention blocks that READ will fill go into
`_skip_zero_block_ids`, and `_get_new_block_ids_to_zero` removes them from the step's zero
list. The zeroing would be queued on the compute stream behind the forward in flight, while
the READ lands whenever UCX completes it, so zeroing those blocks could wipe KV that already
arrived.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass

from engine.deferred_free import DeferredFree
from engine.messages import (
    CachedRequestData,
    InvalidRequestError,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    RequestOutput,
    SchedulerOutput,
    request_output,
)
from engine.pd import DisaggConfig, Disaggregation, LoadStart
from engine.request import Request, RequestStatus
from engine.stop import StopChecker
from kv.kv_cache_manager import KVCacheManager

log = logging.getLogger(__name__)

_MAX_ABORTED_IDS = 10_000


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, stop: StopChecker, disagg: DisaggConfig | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.stop = stop
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_step = 0
        self.freed = DeferredFree(kv)
        self.pd = Disaggregation(disagg, kv, self.freed, self.requests, self._fail_now) if disagg else None
        self._skip_zero_block_ids: set[int] = set()
        self.blocks_skipped = 0
        self._finished_for_workers: list[str] = []
        self.blocks_zeroed = 0
        self.num_preemptions = 0
        # vLLM's prefix-cache counters, in tokens: prompts looked up when admitted (or when
        # their load started), and the part found in this engine's own cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Ids aborted before they arrived (a client cancelled while its add_request was in
        # flight, and the abort overtook it): the late add_request is refused.
        self._aborted: dict[str, None] = {}
        self._outputs: list[RequestOutput] = []  # produced while scheduling; see take_outputs
        # Per step in flight, with a prefix cache: where each scheduled request's chunk starts,
        # to withdraw what a failed step published. Without one nothing is shared, so nothing
        # is recorded.
        self._step_starts: dict[int, dict[str, int]] = {}

    # -- requests ---------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.req_id in self._aborted:
            raise InvalidRequestError(f"request {req.req_id!r} was aborted before it arrived")
        if req.req_id in self.requests or req.req_id in self.freed or (self.pd and self.pd.owns(req.req_id)):
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use", param="request_id")
        if not req.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        self.check_length(req.num_prompt_tokens, req.sampling.max_tokens)
        if req.kv_transfer_params is not None:
            if self.pd is None:
                raise InvalidRequestError("this engine does not load remote KV", param="kv_transfer_params")
            self.pd.check_request(req)
        limits = self.stop.plain_limits(req)
        if limits is not None and not req.wants_logprobs and not req.do_remote_decode:
            req.plain_until, req.plain_stop_id = limits
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse what cannot fit the context or the whole cache, before any work is done."""
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
                f"{total}, beyond the model's context of {self.config.max_model_len} tokens",
                param="max_tokens",
            )
        need = sum(m.num_required_blocks(total) for m in self.kv.managers)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need} KV blocks; the cache has {self.kv.num_blocks}", param="max_tokens"
            )

    def abort(self, req_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks. On a prefill engine this also drops KV held for
        a decode side that will never read it (the client left between the two engines)."""
        if self.pd is not None:
            self.pd.release_held(req_id)
        req = self.requests.get(req_id)
        if req is None:
            if req_id not in self.freed and not (self.pd and self.pd.owns(req_id)):
                self._aborted[req_id] = None
                while len(self._aborted) > _MAX_ABORTED_IDS:
                    del self._aborted[next(iter(self._aborted))]
            return None
        self._finish(req, "abort")
        return self._output(req)

    def take_outputs(self) -> list[RequestOutput]:
        """Requests that ended outside a step's result (a load refused while scheduling)."""
        outs, self._outputs = self._outputs, []
        return outs

    def disaggregation(self) -> Disaggregation:
        """The PD component, which every PD path needs; its absence is a wiring bug, reported as
        one (not an `assert`, which `python -O` removes)."""
        if self.pd is None:
            raise RuntimeError("a PD code path ran in a colocated engine")
        return self.pd

    def has_work(self) -> bool:
        """Anything left to schedule, to wait for or to tell the workers; an idle engine holds
        no block and its workers hold no request (a finish is told them in a step)."""
        return bool(
            self._finished_for_workers
            or self.waiting
            or self.running
            or len(self.freed)
            or (self.pd is not None and self.pd.has_work())
        )

    # -- scheduling -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """Plan the next step, or None when nothing can run now (all requests wait on
        tokens or fences that in-flight steps will resolve)."""
        step = self._next_step
        budget = self.config.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        tokens: dict[str, int] = {}
        starts: dict[str, int] = {}  # where each scheduled chunk starts (to undo a failed one)
        preempted = False

        covered, running, prefix_caching = self.kv.covered, RequestStatus.RUNNING, self.kv.enable_prefix_caching
        checkpointing, block_size = self.kv.checkpointing, self.kv.block_size
        for req in list(self.running):
            if budget == 0 or preempted:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            # The tokens it has (prompt, outputs, placeholders) less those computed, unless the
            # last token it may produce is already being sampled. This loop runs for every
            # running request every step, so it is spelled out: no `min`, and `_commit` inlined.
            num_tokens = req.num_tokens_with_placeholders
            if num_tokens >= req.max_num_tokens:
                continue
            req_id, computed = req.req_id, req.num_computed_tokens
            n = num_tokens - computed
            if n > budget:
                n = budget
            if n <= 0:
                continue
            if n > 1 and checkpointing:
                n = self._to_checkpoint(req, computed, n)
            if computed + n > covered.get(req_id, -1):
                # Not the common decode step, which its blocks already hold: it needs blocks.
                while (new_ids := self.kv.allocate_slots(req_id, computed + n)) is None:
                    victim = self._pick_victim(req, tokens)
                    if not self._preempt(victim):
                        # Its blocks come back when the step in flight reports; admitting queued
                        # requests meanwhile would take what the running ones are waiting for.
                        preempted = True
                        break
                    if victim is req:
                        break
                if new_ids is None:
                    continue
                if any(new_ids):  # otherwise the worker continues from its own count: no message
                    cached.append(CachedRequestData(req_id, computed, list(new_ids)))
            tokens[req_id] = n
            req.num_computed_tokens = computed + n
            req.last_step = step
            if computed + n == num_tokens:
                req.num_tokens_with_placeholders = num_tokens + 1  # this step samples its next token
            if prefix_caching:
                starts[req_id] = computed
                self._publish(req)
                if checkpointing and (computed + n) % block_size == 0:
                    self._checkpoint(req)
            budget -= n

        pd = self.pd
        while pd is not None and pd.loaded and budget > 0 and not preempted:
            req = pd.loaded[0]
            n = self._admit(req, req.num_computed_tokens, 0, budget, step, new_reqs, cached, tokens, starts)
            if n == 0:
                break
            pd.loaded.popleft()
            budget -= n

        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) + (pd.num_admitted if pd else 0) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.last_step > self.freed.last_reported:
                break  # preempted with a step still in flight: its blocks are not free yet
            looked_up = prefix_caching and not req.resumed and req.sampling.prompt_logprobs is None
            if not looked_up:
                # Recomputed from scratch (its old blocks are gone), or every prompt position's
                # logits are wanted, which a prefix-cache hit would skip.
                hit = fresh_hit = 0
            else:
                hit = fresh_hit = self.kv.get_computed_blocks(req.req_id, req.prompt_token_ids)
            if pd is not None:
                load = pd.start_load(req, hit, fresh_hit, step)
                if load is LoadStart.NO_ROOM:
                    break
                if load is LoadStart.STARTED:
                    self.waiting.popleft()
                    self._count_lookup(req, hit, looked_up)
                    # The fix (docs/design.md §2): the blocks this load fills stay out of the zero list.
                    self._skip_zero_block_ids.update(pd.covered_block_ids(req))
                    continue
                if load is LoadStart.FAILED:
                    continue  # ended by the failure policy, and so dequeued
            n = self._admit(req, hit, fresh_hit, budget, step, new_reqs, cached, tokens, starts)
            if n == 0:
                break
            self.waiting.popleft()
            self._count_lookup(req, hit, looked_up)
            if pd is not None:
                pd.computed_locally(req)
            budget -= n

        meta = pd.connector.build_connector_meta() if pd is not None else None
        polling = pd is not None and pd.needs_polling()
        if not tokens and meta is None and not polling and not self._finished_for_workers:
            return None
        self._next_step += 1
        if starts:
            self._step_starts[step] = starts
        finished, self._finished_for_workers = self._finished_for_workers, []
        zero = self._get_new_block_ids_to_zero(step)
        restores, saves = self.kv.take_state_copies()
        return SchedulerOutput(step, new_reqs, cached, tokens, finished, zero, meta, restores, saves)

    def _admit(
        self,
        req: Request,
        hit: int,
        fresh_hit: int,
        budget: int,
        step: int,
        new_reqs: list[NewRequestData],
        cached: list[CachedRequestData],
        tokens: dict[str, int],
        starts: dict[str, int],
    ) -> int:
        """Start running a queued request from `hit` computed tokens (`fresh_hit` of them a
        prefix-cache hit just found); the tokens scheduled, or 0 (nothing changed) if its blocks
        do not fit."""
        n = min(req.num_tokens_with_placeholders - hit, budget)
        if n > 1 and self.kv.checkpointing:
            n = self._to_checkpoint(req, hit, n)
        if n <= 0 or self.kv.allocate_slots(req.req_id, hit + n, num_new_computed_tokens=fresh_hit) is None:
            return 0
        if fresh_hit and self.kv.checkpointing:
            self.kv.restore_state(req.req_id)  # it starts from a copy of the hit's state
        elif hit and self.kv.is_checkpoint(hit, req.num_prompt_tokens):
            # A decode engine's loaded prompt: its slot holds the state after `hit` already.
            self.kv.checkpoint(req.req_id, hit, req.all_token_ids, before_forward=True)
        req.num_computed_tokens = hit
        req.resumed = False
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        blocks = [list(b) for b in self.kv.get_block_ids(req.req_id)]
        if req.known_to_workers:
            cached.append(CachedRequestData(req.req_id, hit, blocks, resumed=True))
        else:
            new_reqs.append(
                NewRequestData(req.req_id, list(req.prompt_token_ids), req.sampling, blocks, hit, req.scored_tail)
            )
            req.known_to_workers = True
        self._commit(req, n, step, tokens, starts)
        return n

    def _commit(self, req: Request, n: int, step: int, tokens: dict[str, int], starts: dict[str, int]) -> None:
        """Schedule `n` tokens of an admitted request (the running loop in `schedule` does the
        same inline)."""
        tokens[req.req_id] = n
        start = req.num_computed_tokens
        req.num_computed_tokens = start + n
        req.last_step = step
        if start + n == req.num_tokens_with_placeholders:
            req.num_tokens_with_placeholders += 1  # this step samples its next token
        if self.kv.enable_prefix_caching:
            starts[req.req_id] = start
            self._publish(req)
            if self.kv.checkpointing and (start + n) % self.kv.block_size == 0:
                self._checkpoint(req)

    def _publish(self, req: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix cache; only a step that
        completes a block builds the token list to hash."""
        upto = min(req.num_computed_tokens, req.num_tokens)
        if self.kv.has_new_full_block(req.req_id, upto):
            self.kv.cache_full_blocks(req.req_id, req.all_token_ids, upto)

    def _count_lookup(self, req: Request, hit: int, looked_up: bool) -> None:
        if looked_up:
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += hit

    def _to_checkpoint(self, req: Request, computed: int, n: int) -> int:
        """A chunk of `n` tokens from `computed`, cut to end at the next state checkpoint
        boundary it would cross: the worker copies the state after a step, so a checkpoint
        exists only where a step ends (docs/design.md §21)."""
        end = computed + n
        boundary = self.kv.next_checkpoint(computed, req.num_prompt_tokens)
        while computed < boundary < end and self.kv.has_checkpoint(req.req_id, boundary):
            boundary = self.kv.next_checkpoint(boundary, req.num_prompt_tokens)  # cached: no step need end there
        return boundary - computed if computed < boundary < end else n

    def _checkpoint(self, req: Request) -> None:
        """Keep the state after this step's chunk if the policy wants that boundary."""
        end = req.num_computed_tokens
        if self.kv.is_checkpoint(end, req.num_prompt_tokens):
            self.kv.checkpoint(req.req_id, end, req.all_token_ids)

    def _pick_victim(self, req: Request, scheduled: dict[str, int]) -> Request:
        """The lowest-priority running request not already in this step (possibly `req`)."""
        for cand in reversed(self.running):
            if cand.req_id not in scheduled:
                return cand
        return req

    def _preempt(self, req: Request) -> bool:
        """Send `req` back to the front of the queue for recompute; True if its blocks
        are free already."""
        log.debug("preempting %s at %d computed tokens", req.req_id, req.num_computed_tokens)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.resumed = True
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        return self.freed.release(req.req_id, req.last_step)

    def _get_new_block_ids_to_zero(self, step: int) -> list[int] | None:
        """This step's new attention blocks minus those a remote load covers; the skip set
        only ever edits the list being built, never one already shipped. Zeroing a block uses
        it: its owner's blocks are not freed before `step` reports."""
        owners = self.kv.take_blocks_to_zero()
        if not owners and not self._skip_zero_block_ids:
            return None  # most decode steps: no request crossed into a new block
        skip, self._skip_zero_block_ids = self._skip_zero_block_ids, set()
        if not self.kv.zeroes_new_blocks:
            return None
        kept = [b for b in owners if b not in skip]
        for req_id in {owners[b] for b in kept}:
            # A request aborted while its READ is in flight is no longer in the table, but its
            # blocks are still its own.
            req = self.requests.get(req_id) or self.disaggregation().loading[req_id]
            req.last_step = max(req.last_step, step)
        self.blocks_zeroed += len(kept)
        self.blocks_skipped += len(owners) - len(kept)
        return kept or None

    # -- results ----------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> OutputBatch:
        """Apply a finished step: record sampled tokens, check stops, release fenced blocks."""
        if result.step_id != out.step_id:
            raise RuntimeError(f"step {out.step_id} got the result of step {result.step_id}")
        # The common case, a token for a request that goes on, adds to four flat lists: this
        # loop runs for every running request every step, so a plain request (see
        # `Request.plain_until`) is settled with a compare and two lookups.
        ids: list[str] = []
        tokens: list[int] = []
        prompts: list[int] = []
        counts: list[int] = []
        others: list[RequestOutput] = []
        requests, check, finished = self.requests, self.stop.check, RequestStatus.FINISHED
        for req_id, run in result.prompt_logprobs.items():
            req = requests.get(req_id)
            if req is not None and req.status is not finished and not req.add_prompt_logprobs(run):
                have = 1 + len(req.prompt_logprobs)
                others += self._fail(req_id, f"prompt logprobs from token {run.start}; token {have} was expected")
        for req_id, token in result.sampled.items():
            req = requests.get(req_id)
            if req is None or req.status is finished:
                continue  # finished while this step ran: the token is surplus
            outputs = req.output_token_ids  # the token takes the place of a placeholder
            if req.plain_until:
                outputs.append(token)
                num_outputs = len(outputs)
                logprobs = False
                reason = None
                if num_outputs >= req.plain_until or token == req.plain_stop_id:
                    reason = check(req)
            else:
                if req.do_remote_decode:
                    req.num_tokens_with_placeholders -= 1  # the prompt is in: no output
                    if req.status is RequestStatus.PREEMPTED:
                        # Preempted while its last chunk ran: its blocks are going, so no hand-over;
                        # the workers forget the sampled token with the request, and it recomputes.
                        self._finished_for_workers.append(req_id)
                        req.known_to_workers = False
                        continue
                    params = self.disaggregation().hand_over(req, result.kv_checksums.get(req_id))
                    self._finish(req, "length", keep_blocks=True)
                    others.append(dataclasses.replace(self._output(req), kv_transfer_params=params))
                    continue
                outputs.append(token)
                num_outputs = len(outputs)
                logprobs = req.wants_logprobs
                if req.sampling.logprobs and req_id in result.logprobs:
                    req.output_logprobs.append(result.logprobs[req_id])
                    if req.sampling.top_logprobs:
                        req.output_top_logprobs.append(result.top_logprobs.get(req_id, []))
                reason = check(req)
            if reason is not None:
                self._finish(req, reason)
            elif not logprobs and req.num_emitted == num_outputs - 1:
                ids.append(req_id)
                tokens.append(token)
                prompts.append(req.num_prompt_tokens)
                counts.append(num_outputs)
                req.num_emitted = num_outputs
                continue
            others.append(self._output(req))
        starts = self._step_starts.pop(out.step_id, {})
        for req_id, why in result.failed_reqs.items():
            others.extend(self._worker_failed(out, starts, req_id, why))
        if self.pd is not None:
            self.pd.transfers_ended(result)
        self.freed.reported(out.step_id)
        if self._outputs:
            others[:0] = self.take_outputs()  # ended outside the results (a refused load)
        return OutputBatch(ids, tokens, prompts, counts, others)

    def _worker_failed(
        self, out: SchedulerOutput, starts: dict[str, int], req_id: str, why: str
    ) -> list[RequestOutput]:
        """A request the worker could not run fails alone. With a prefix cache, the blocks it
        was to fill in that step were published when the step was scheduled: withdraw them,
        and fail whoever already took them as a hit."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return []
        results = []
        n = out.num_scheduled_tokens.get(req_id, 0)
        start = starts.get(req_id)
        if n and start is not None:
            for other in sorted(self.kv.uncache_blocks(req_id, start, start + n)):
                results.extend(self._fail(other, f"a prefix it shared was lost with a failed request ({why})"))
        return self._fail(req_id, why) + results

    def _fail(self, req_id: str, why: str) -> list[RequestOutput]:
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return []
        log.warning("request %s failed: %s", req_id, why)
        req.error = why
        self._finish(req, "error")
        return [self._output(req)]

    def _fail_now(self, req: Request, why: str) -> None:
        """End a request with an error outside a step's results (a load failed by policy); its
        output goes out with the next batch."""
        req.error = why
        self._finish(req, "error")
        self._outputs.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput:
        emitted, num_outputs = req.num_emitted, len(req.output_token_ids)
        new = req.output_token_ids[emitted:]
        logprobs = req.output_logprobs[emitted:] if req.sampling.logprobs else None
        req.num_emitted = num_outputs
        out = request_output(
            req.req_id, new, logprobs, req.finish_reason, req.num_prompt_tokens, num_outputs, req.error
        )
        if req.wants_logprobs:
            top = req.output_top_logprobs[emitted:] if req.sampling.top_logprobs else None
            prompt = req.take_prompt_logprobs()
            if top is not None or prompt is not None:
                out = dataclasses.replace(out, top_logprobs=top, prompt_logprobs=prompt)
        return out

    def _finish(self, req: Request, reason: str, keep_blocks: bool = False) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        # A load in flight may still write the blocks: they are freed when it ends.
        if self.pd is not None and self.pd.finished(req):
            keep_blocks = True
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.forget_blocks_to_zero(req.req_id)
        if not keep_blocks:
            self.freed.release(req.req_id, req.last_step)
        del self.requests[req.req_id]
        if req.known_to_workers:
            self._finished_for_workers.append(req.req_id)
