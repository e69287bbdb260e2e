"""The PD half of the scheduler: what a disaggregated engine does beyond scheduling.

A decode engine checks the `kv_transfer_params` it is given, starts the load of a granted
prompt (the blocks it fills go into the skip set: docs/design.md §2), and applies the load's
end: done, failed, or ended too late for its lease (docs/design.md §4, §6). A prefill engine
hands a computed prompt over and holds its blocks until the decode side has read them or
the lease ends. The connector's scheduler half (kv/nixl/scheduler.py) keeps the grants,
loads and leases; this half keeps the requests and their blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engine.messages import InvalidRequestError, ModelRunnerOutput, RequestOutput
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.deferred_free import DeferredFree
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


class DisaggScheduling:
    """Mixed into `Scheduler`, whose state it shares (declared here for the reader)."""

    kv: KVCacheManager
    freed: DeferredFree
    disagg: DisaggConfig | None
    connector: NixlSchedulerConnector | None
    loading: dict[str, Request]
    loaded: deque[Request]
    _held: dict[str, int]
    _skip_zero_block_ids: set[int]
    _outputs: list[RequestOutput]
    num_failed_loads: int
    num_expired_leases: int
    waiting: deque[Request]
    requests: dict[str, Request]

    def _finish(self, req: Request, reason: str, keep_blocks: bool = False) -> None:
        raise NotImplementedError

    def _output(self, req: Request) -> RequestOutput:
        raise NotImplementedError

    @property
    def link(self) -> NixlSchedulerConnector:
        """The connector, which every PD path needs; its absence is a wiring bug, reported as one
        (not an `assert`, which `python -O` removes)."""
        if self.connector is None:
            raise RuntimeError("a PD code path ran in an engine without a KV connector")
        return self.connector

    @property
    def pd(self) -> DisaggConfig:
        if self.disagg is None:
            raise RuntimeError("a PD code path ran in an engine without a disaggregation config")
        return self.disagg

    @staticmethod
    def _params(req: Request) -> KVTransferParams:
        if req.kv_transfer_params is None:
            raise RuntimeError(f"request {req.req_id} reached a KV-load path without kv_transfer_params")
        return req.kv_transfer_params

    def _check_transfer(self, req: Request) -> None:
        """kv_transfer_params arrive from outside: a wrong shape must be a clear rejection, not
        a stalled queue or a failed worker step."""
        params = self._params(req)
        if self.connector is None:
            raise InvalidRequestError("this engine does not load remote KV", param="kv_transfer_params")
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
        for group, manager, ids in zip(self.kv.groups, self.kv.managers, params.remote_block_ids):
            need = manager.num_required_blocks(params.num_tokens)
            if len(ids) != need:
                raise InvalidRequestError(
                    f"kv_transfer_params give {len(ids)} {group.kind} blocks for "
                    f"{params.num_tokens} tokens, expected {need}",
                    param="kv_transfer_params",
                )

    def _start_remote_load(self, req: Request, hit: int, external: int, step: int) -> None:
        """The fix (docs/design.md §2): the blocks this load fills stay out of the zero list."""
        req.num_computed_tokens = hit
        req.num_external_tokens = external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.last_step = step  # this step ships the load and the zero list touching its blocks
        self.loading[req.req_id] = req
        if not self.pd.debug_zero_loaded_blocks:
            self._skip_zero_block_ids.update(self.kv.get_zeroing_block_ids_in_range(req.req_id, hit, hit + external))
        self.link.update_state_after_alloc(
            req.req_id, self._params(req), self.kv.get_block_ids(req.req_id), hit, external
        )

    def _hand_over(self, req: Request, checksums: list[list[list[list[int]]]] | None = None) -> RequestOutput:
        """Prefill side: the prompt is in; keep the blocks for the decode side to read.
        `checksums` (--kv-verify): [prefill rank][decode rank][group][block]."""
        block_ids = self.kv.get_block_ids(req.req_id)
        shape = [len(b) for b in block_ids]
        if checksums is not None and any([len(g) for g in t] != shape for row in checksums for t in row):
            raise RuntimeError(f"request {req.req_id}: the worker checksummed other blocks than the scheduler's")
        params = self.link.request_finished(
            req.req_id, self.pd.engine_id, self.pd.agent_name, block_ids, req.num_prompt_tokens, checksums
        )
        self._held[req.req_id] = req.last_step
        self._finish(req, "length", keep_blocks=True)
        out = self._output(req)
        return dataclasses.replace(out, kv_transfer_params=params.to_dict())

    def leases_to_renew(self) -> dict[str, dict[str, str]]:
        """Decode side: the leases a request still needs, by prefill engine: its request id
        there -> ours. A request needs its lease from arrival until its load has ended."""
        wanted: dict[str, dict[str, str]] = {}
        for req in itertools.chain(self.waiting, self.loading.values()):
            params = req.kv_transfer_params
            if params is not None and not req.load_done and not req.finished:
                wanted.setdefault(params.remote_engine_id, {})[params.request_id] = req.req_id
        return wanted

    def lease_renewed(self, deadlines: Mapping[str, float]) -> None:
        """Decode side: deadlines a prefill engine granted (docs/design.md §12); later loads and
        the check after a READ (`lease_ok`) go by them."""
        for req_id, deadline in deadlines.items():
            req = self.requests.get(req_id)
            params = None if req is None or req.load_done else req.kv_transfer_params
            if req is not None and params is not None and deadline > params.expires_at:
                req.kv_transfer_params = dataclasses.replace(params, expires_at=deadline)

    def renew_leases(self, req_ids: list[str]) -> dict[str, float]:
        """Prefill side: extend the leases still held; the granted deadlines."""
        granted = {}
        for req_id in req_ids:
            if req_id in self._held and (deadline := self.link.renew(req_id)) is not None:
                granted[req_id] = deadline
        return granted

    def _transfers_ended(self, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Loads that landed or failed (decode side); blocks read or leases ended (prefill side)."""
        outputs = []
        for req_id in result.finished_recving:
            outputs.extend(self._load_finished(req_id, None))
        for req_id, bad in result.failed_loads.items():
            outputs.extend(self._load_finished(req_id, bad))
        for req_id in [*result.finished_sending, *self.link.expired()]:
            self._release_held(req_id)
        return outputs

    def _release_held(self, req_id: str) -> None:
        """Prefill side: the decode side read (or abandoned) the blocks, or the lease ended."""
        if self.connector is not None:
            self.connector.release(req_id)
        if req_id in self._held:
            self.freed.release(req_id, self._held.pop(req_id))

    def _load_finished(self, req_id: str, bad_blocks: list[int] | None) -> list[RequestOutput]:
        req = self.loading.pop(req_id, None)
        if req is None:
            return []
        if req.finished:  # aborted while its pages were being written: free them now
            self.freed.release(req.req_id, req.last_step)
            return []
        req.load_done = True
        req.status = RequestStatus.WAITING
        why = None
        if bad_blocks is not None:
            why = f"KV transfer from the prefill engine failed for blocks {sorted(bad_blocks)}"
        elif not self.link.lease_ok(self._params(req)):
            # The READ ended too close to the lease's end: the pages may have been reused.
            self.num_expired_leases += 1
            bad_blocks = self.kv.get_zeroing_block_ids_in_range(
                req.req_id, req.num_computed_tokens, req.num_computed_tokens + req.num_external_tokens
            )
            why = "its KV lease at the prefill engine expired during the load"
        if why is None:
            req.num_computed_tokens += req.num_external_tokens
        else:
            if not self._load_failed(req, why):
                return []
            valid = self._valid_prefix(req, set(bad_blocks or ()))
            self.kv.record_blocks_for_zeroing(req.req_id, valid)  # I2 (docs/design.md §8): zeroed before recompute
            req.num_computed_tokens = valid
        self.loaded.append(req)
        return []

    def _load_failed(self, req: Request, why: str) -> bool:
        """Apply the load-failure policy: True to recompute, False if the request failed."""
        self.num_failed_loads += 1
        req.load_done = True
        if self.pd.load_failure_policy == "recompute":
            log.info("request %s recomputes its prompt: %s", req.req_id, why)
            return True
        req.error = why
        self._finish(req, "error")
        self._outputs.append(self._output(req))
        return False

    def _valid_prefix(self, req: Request, bad: set[int]) -> int:
        """Tokens still good after a partial load failure: up to the first invalid attention
        block. A hybrid model keeps none: its Mamba state exists only at the prompt's end."""
        if self.kv.zeroes_new_blocks:
            return 0
        end = req.num_computed_tokens + req.num_external_tokens
        for group, ids in zip(self.kv.groups, self.kv.get_block_ids(req.req_id)):
            if group.kind == "attention":
                first_bad = next((i for i, b in enumerate(ids) if b in bad), len(ids))
                end = min(end, first_bad * self.kv.block_size)
        return end
