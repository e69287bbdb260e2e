"""Disaggregation: what a prefill or decode engine does beyond scheduling, in one component.

The scheduler holds one `Disaggregation` when it serves a PD role (none when colocated) and
calls it at the few points where a PD request differs from a colocated one:

- decode side: it checks the `kv_transfer_params` a request arrives with, grants the tokens
  the transfer supplies, allocates the whole prompt and starts the load; the scheduler puts
  the attention blocks that load fills (`covered_block_ids`) into its `_skip_zero_block_ids`
  (the fix, docs/design.md §2). It applies the load's end: done, failed, or ended too late
  for its lease (§4, §6), and owns the requests in between (`loading`, then `loaded`).
- prefill side: the prompt split (the engine computes `prompt[:-1]`, §5), the hand-over of a
  computed prompt, and one record per request held for a decode side (`HeldKV`: the step
  that last used its blocks, the lease's deadline, the ranks read so far) until every rank
  has been read, the decode side abandons it, or the lease ends (§6, §11).

The connector's scheduler half (kv/nixl/scheduler.py) says what a transfer is (grants, load
specs, notifications, lease arithmetic); this component keeps the requests and their blocks.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from engine.deferred_free import DeferredFree
from engine.messages import InvalidRequestError, Logprobs, ModelRunnerOutput, RequestOutput, SamplingParams
from engine.request import Request, RequestStatus
from kv.kv_cache_manager import KVCacheManager
from kv.nixl.scheduler import NixlSchedulerConnector
from kv.nixl.transfer_params import KVTransferParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    role: Literal["prefill", "decode"]
    engine_id: str
    lease_s: float = 10.0
    # Debug only: zero the blocks a remote load covers, as before the fix (docs/design.md §8, I6).
    debug_zero_loaded_blocks: bool = False
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    agent_name: str = ""  # prefill: the worker's NIXL agent, named in the KVTransferParams handed out
    tp_size: int = 1  # the engine's ranks: a held request is read once every rank was notified


@dataclass(slots=True)
class HeldKV:
    """Prefill side: a handed-over request's blocks, kept for the decode side to read."""

    last_step: int  # the last step that used the blocks: their free is fenced on it (§3)
    expires_at: float  # the lease (wall-clock seconds); renewed by the decode side's heartbeats
    ranks_read: int = 0  # prefill ranks whose readers have all notified


class LoadStart(enum.Enum):
    """What the decode side did with a waiting request that carries `kv_transfer_params`."""

    LOCAL = "local"  # nothing to load (no grant, a local hit covers it, or recompute by policy)
    STARTED = "started"  # blocks for the whole prompt allocated, the READ ships this step
    NO_ROOM = "no_room"  # the prompt's blocks do not fit now: it stays at the queue's head
    FAILED = "failed"  # the lease ran out and the policy failed the request (it has ended)


# The engine's stats this component adds (all 0 on a colocated engine).
# `loaded_tokens`: prompt tokens a decode engine's loads supplied, beside its own prefix hits.
STAT_NAMES = ("loading", "held_for_decode", "failed_loads", "expired_leases", "loaded_tokens")

# The scheduler's way to end a request with an error from here: finish it, and queue its output.
FailRequest = Callable[[Request, str], None]


class Disaggregation:
    def __init__(
        self,
        config: DisaggConfig,
        kv: KVCacheManager,
        freed: DeferredFree,
        requests: Mapping[str, Request],
        fail: FailRequest,
    ) -> None:
        self.config = config
        self.kv = kv
        self.freed = freed
        self.requests = requests  # the scheduler's table of live requests, read here
        self.fail = fail
        self.connector = NixlSchedulerConnector(kv.managers, config.lease_s)
        self.loading: dict[str, Request] = {}  # waiting for their remote KV
        # Loads that ended (or failed, to be recomputed): each owns blocks for its whole prompt,
        # so it is admitted ahead of `waiting`, where a preempted request waiting for memory
        # could otherwise block it while it holds the very blocks that request needs.
        self.loaded: deque[Request] = deque()
        self.held: dict[str, HeldKV] = {}
        self.num_failed_loads = 0
        self.num_expired_leases = 0
        self.num_loaded_tokens = 0

    # -- both sides -------------------------------------------------------------------

    def owns(self, req_id: str) -> bool:
        """Whether the id is still taken here after its request left the scheduler's table."""
        return req_id in self.held or req_id in self.loading

    @property
    def num_admitted(self) -> int:
        """Requests past the queue that are not running yet: they count against max_num_seqs."""
        return len(self.loading) + len(self.loaded)

    def needs_polling(self) -> bool:
        """Transfers in flight only report through a step's result, so keep stepping."""
        return bool(self.loading or self.held)

    def has_work(self) -> bool:
        return bool(self.loaded or self.needs_polling() or self.connector.has_pending_meta)

    def stats(self) -> dict[str, int]:
        values = (
            len(self.loading),
            len(self.held),
            self.num_failed_loads,
            self.num_expired_leases,
            self.num_loaded_tokens,
        )
        return dict(zip(STAT_NAMES, values))

    def finished(self, req: Request) -> bool:
        """The request ended (any reason); True if its blocks must stay allocated because a READ
        in flight may still write them (they are freed when the load ends)."""
        if req in self.loaded:
            self.loaded.remove(req)
        if req.req_id in self.loading:
            return True  # a READ in flight notifies when it ends
        params = req.kv_transfer_params
        if params is not None and not req.load_done:
            self.connector.notify_abandoned(params)  # never read: the prefill side frees it now
            req.load_done = True
        return False

    # -- prefill side -----------------------------------------------------------------

    def prefill_request(
        self, req_id: str, prompt: list[int], sampling: SamplingParams
    ) -> tuple[list[int], SamplingParams] | RequestOutput:
        """What a prefill engine computes of a `do_remote_decode` request: the prompt but its
        last token, greedy, one step (§5). The decode side recomputes that token, which gives
        it the first output's logits, and a hybrid's state is then exactly the state after
        prompt[:-1]. A one-token prompt has nothing to prefill: the hand-over, at once.

        Only the prompt's logprobs are kept of the sampling: the prefill engine runs every
        prompt position but the last, whose row scores the last token (the scored tail), so
        they travel back with the hand-over and the decode side computes none."""
        if len(prompt) > 1:
            return prompt[:-1], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=sampling.prompt_logprobs)
        empty = tuple(() for _ in self.kv.groups)
        params = KVTransferParams(self.config.engine_id, self.config.agent_name, empty, 0, req_id)
        scored = None if sampling.prompt_logprobs is None else Logprobs(1, [], [])
        return RequestOutput(req_id, [], None, "length", 1, 0, kv_transfer_params=params, prompt_logprobs=scored)

    def hand_over(self, req: Request, checksums: list[list[list[list[int]]]] | None = None) -> KVTransferParams:
        """The prompt is in: hold its blocks for the decode side under a lease, and say where
        they are. `checksums` (--kv-verify): [prefill rank][decode rank][group][block]."""
        block_ids = self.kv.get_block_ids(req.req_id)
        shape = [len(b) for b in block_ids]
        if checksums is not None and any([len(g) for g in t] != shape for row in checksums for t in row):
            raise RuntimeError(f"request {req.req_id}: the worker checksummed other blocks than the scheduler's")
        params = self.connector.describe(
            req.req_id, self.config.engine_id, self.config.agent_name, block_ids, req.num_prompt_tokens, checksums
        )
        if checksums is None and self.kv.checkpointing:  # --kv-verify checksums name the table's pages only
            tokens, pages = self.kv.hand_over_checkpoint(req.req_id, req.num_prompt_tokens)
            params = dataclasses.replace(params, checkpoint_tokens=tokens, checkpoint_block_ids=pages)
        self.held[req.req_id] = HeldKV(req.last_step, params.expires_at)
        return params

    def renew_leases(self, req_ids: list[str]) -> dict[str, float]:
        """A decode engine's heartbeat: extend the leases still held; the granted deadlines
        (none for a request read, abandoned or expired: its blocks may be gone)."""
        granted = {}
        for req_id in req_ids:
            held = self.held.get(req_id)
            if held is not None:
                held.expires_at = granted[req_id] = self.connector.lease_deadline()
        return granted

    def release_held(self, req_id: str) -> None:
        """The decode side read or abandoned the blocks, the lease ended, or the client left."""
        held = self.held.pop(req_id, None)
        if held is not None:
            self.freed.release(req_id, held.last_step)

    def _blocks_read(self, req_ids: list[str]) -> None:
        """Notifications, one per prefill rank whose readers are done; the blocks go back once
        every rank has been read. A notification for a request no longer held is dropped."""
        for req_id in req_ids:
            held = self.held.get(req_id)
            if held is not None:
                held.ranks_read += 1
                if held.ranks_read >= self.config.tp_size:
                    self.release_held(req_id)

    def _leases_ended(self) -> None:
        now = self.connector.clock()
        for req_id in [r for r, held in self.held.items() if held.expires_at <= now]:
            self.release_held(req_id)

    # -- decode side ------------------------------------------------------------------

    def check_request(self, req: Request) -> None:
        """kv_transfer_params arrive from another engine: a wrong shape (a bug, or two versions
        of raypd side by side) must be a clear rejection, not a stalled queue or a failed step."""
        params = _params(req)
        if params.num_tokens >= req.num_prompt_tokens:
            raise InvalidRequestError(
                f"kv_transfer_params cover {params.num_tokens} tokens of a {req.num_prompt_tokens}-token prompt",
                param="kv_transfer_params",
            )
        if len(params.remote_block_ids) != len(self.kv.groups):
            raise InvalidRequestError(
                f"kv_transfer_params name {len(params.remote_block_ids)} cache groups, "
                f"this model has {len(self.kv.groups)}",
                param="kv_transfer_params",
            )
        num_states = sum(g.kind == "mamba" for g in self.kv.groups)
        if params.checkpoint_block_ids and (
            len(params.checkpoint_block_ids) != num_states or params.checkpoint_tokens % self.kv.block_size
        ):
            raise InvalidRequestError(
                f"kv_transfer_params name a state checkpoint of {len(params.checkpoint_block_ids)} pages after "
                f"{params.checkpoint_tokens} tokens; this model has {num_states} state groups and blocks of "
                f"{self.kv.block_size} tokens",
                param="kv_transfer_params",
            )
        for group, manager, ids in zip(self.kv.groups, self.kv.managers, params.remote_block_ids):
            need = manager.num_required_blocks(params.num_tokens)
            if len(ids) != need:
                raise InvalidRequestError(
                    f"kv_transfer_params give {len(ids)} {group.kind} blocks for "
                    f"{params.num_tokens} tokens, expected {need}",
                    param="kv_transfer_params",
                )

    def refused(self, params: KVTransferParams) -> None:
        """The engine refused a request that came with a transfer: the prefill side frees now."""
        self.connector.notify_abandoned(params)

    def start_load(self, req: Request, hit: int, fresh_hit: int, step: int) -> LoadStart:
        """A waiting request at the head of the queue, `hit` tokens of its prompt cached here
        (`fresh_hit` of them a hit just found): start its READ if the transfer still supplies
        tokens and its lease allows one."""
        params = req.kv_transfer_params
        if params is None or req.load_done:
            return LoadStart.LOCAL
        external, _ = self.connector.get_num_new_matched_tokens(params, hit)
        if external <= 0:
            return LoadStart.LOCAL
        if not self.connector.lease_ok(params):  # never start a READ that may race the lease's end
            self.num_expired_leases += 1
            recompute = self._load_failed(req, "its KV lease at the prefill engine expired before the load")
            return LoadStart.LOCAL if recompute else LoadStart.FAILED
        # Blocks for the whole prompt: once loaded, the request can always compute its last
        # prompt token without waiting for memory held by others.
        if self.kv.allocate_slots(req.req_id, req.num_prompt_tokens, num_new_computed_tokens=fresh_hit) is None:
            return LoadStart.NO_ROOM
        req.num_computed_tokens = hit
        req.num_external_tokens = external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.last_step = step  # this step ships the load and the zero list touching its blocks
        self.loading[req.req_id] = req
        checkpoint: list[int] = []
        if params.checkpoint_block_ids and params.checkpoint_tokens > hit and params.page_checksums is None:
            # The prefill side's checkpoint inside the prompt: cached here once the load lands.
            checkpoint = self.kv.adopt_checkpoint(req.req_id, params.checkpoint_tokens, req.prompt_token_ids)
        self.connector.update_state_after_alloc(
            req.req_id, params, self.kv.get_block_ids(req.req_id), hit, external, checkpoint
        )
        return LoadStart.STARTED

    def covered_block_ids(self, req: Request) -> list[int]:
        """The attention blocks the load just started will write, for the scheduler's
        `_skip_zero_block_ids` (§2); none with the debug switch, which restores the bug (I6)."""
        if self.config.debug_zero_loaded_blocks:
            return []
        start = req.num_computed_tokens
        return self.kv.get_zeroing_block_ids_in_range(req.req_id, start, start + req.num_external_tokens)

    def computed_locally(self, req: Request) -> None:
        """The request was admitted to compute its prompt here (a local prefix hit covers the
        grant, or the lease ran out): the prefill side's copy is not needed. Told only now that
        the blocks are ours."""
        if req.kv_transfer_params is not None and not req.load_done:
            self.connector.notify_abandoned(req.kv_transfer_params)
            req.load_done = True

    def leases_to_renew(self) -> dict[str, dict[str, str]]:
        """The leases a request still needs, by prefill engine: its request id there -> ours.
        A request needs its lease from arrival until its load has ended."""
        wanted: dict[str, dict[str, str]] = {}
        for req in self.requests.values():
            params = req.kv_transfer_params
            if params is not None and not req.load_done and not req.finished:
                wanted.setdefault(params.remote_engine_id, {})[params.request_id] = req.req_id
        return wanted

    def lease_renewed(self, deadlines: Mapping[str, float]) -> None:
        """Deadlines a prefill engine granted (§12); later loads and the check after a READ
        (`lease_ok`) go by them."""
        for req_id, deadline in deadlines.items():
            req = self.requests.get(req_id)
            params = None if req is None or req.load_done else req.kv_transfer_params
            if req is not None and params is not None and deadline > params.expires_at:
                req.kv_transfer_params = dataclasses.replace(params, expires_at=deadline)

    def transfers_ended(self, result: ModelRunnerOutput) -> None:
        """Loads that landed or failed (decode side); blocks read or leases ended (prefill side)."""
        for req_id in result.finished_recving:
            self._load_finished(req_id, None)
        for req_id, bad in result.failed_loads.items():
            self._load_finished(req_id, bad)
        self._blocks_read(result.finished_sending)
        self._leases_ended()

    def _load_finished(self, req_id: str, bad_blocks: list[int] | None) -> None:
        req = self.loading.pop(req_id, None)
        if req is None:
            return
        if req.finished:  # aborted while its pages were being written: free them now
            self.freed.release(req.req_id, req.last_step)
            return
        req.load_done = True
        req.status = RequestStatus.WAITING
        why = None
        if bad_blocks is not None:
            why = f"KV transfer from the prefill engine failed for blocks {sorted(bad_blocks)}"
        elif not self.connector.lease_ok(_params(req)):
            # The READ ended too close to the lease's end: the pages may have been reused.
            self.num_expired_leases += 1
            bad_blocks = self.kv.get_zeroing_block_ids_in_range(
                req.req_id, req.num_computed_tokens, req.num_computed_tokens + req.num_external_tokens
            )
            why = "its KV lease at the prefill engine expired during the load"
        self.kv.load_ended(req.req_id, ok=why is None)
        if why is None:
            req.num_computed_tokens += req.num_external_tokens
            self.num_loaded_tokens += req.num_external_tokens
        else:
            if not self._load_failed(req, why):
                return
            valid = self._valid_prefix(req, set(bad_blocks or ()))
            self.kv.record_blocks_for_zeroing(req.req_id, valid)  # I2 (docs/design.md §8): zeroed before recompute
            if valid and self.kv.checkpointing:
                self.kv.restore_state(req.req_id)  # the READ may have written the slot: back to the hit's state
            req.num_computed_tokens = valid
        self.loaded.append(req)

    def _load_failed(self, req: Request, why: str) -> bool:
        """Apply the load-failure policy: True to recompute, False if the request failed."""
        self.num_failed_loads += 1
        req.load_done = True
        if self.config.load_failure_policy == "recompute":
            log.info("request %s recomputes its prompt: %s", req.req_id, why)
            return True
        self.fail(req, why)
        return False

    def _valid_prefix(self, req: Request, bad: set[int]) -> int:
        """Tokens still good after a partial load failure: up to the first invalid attention
        block. A hybrid model keeps its local prefix hit, whose state checkpoint the request
        holds (the READ never writes it), and nothing loaded: the state it loaded exists only
        at the prompt's end (docs/design.md §21)."""
        if self.kv.zeroes_new_blocks:
            return req.num_computed_tokens if self.kv.checkpointing else 0
        end = req.num_computed_tokens + req.num_external_tokens
        for group, ids in zip(self.kv.groups, self.kv.get_block_ids(req.req_id)):
            if group.kind == "attention":
                first_bad = next((i for i, b in enumerate(ids) if b in bad), len(ids))
                end = min(end, first_bad * self.kv.block_size)
        return end


def _params(req: Request) -> KVTransferParams:
    if req.kv_transfer_params is None:
        raise RuntimeError(f"request {req.req_id} reached a KV-load path without kv_transfer_params")
    return req.kv_transfer_params
