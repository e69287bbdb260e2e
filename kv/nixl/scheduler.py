"""The scheduler half of the NIXL connector.

Decode side: it grants the tokens a request's KV transfer supplies (always asynchronously:
the READ runs on UCX's own progress, outside the compute stream), remembers which local
blocks each load fills, and ships the loads to the workers in the step's metadata.
Prefill side: when a request's prompt is computed it describes where the KV lives
(`KVTransferParams`) and when its lease ends; the engine's PD component (engine/pd.py) keeps
the blocks until the decode side has read them (its NIXL notification) or the lease expires.

Leases are in wall-clock seconds (`time.time`), because the deadline travels to the decode
side in `KVTransferParams.expires_at` and is compared there with that engine's clock. The
decode side keeps `LEASE_MARGIN_S` in hand for clock skew between hosts and for the time
between a READ completing and the scheduler learning of it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv.nixl.transfer_params import KVTransferParams
from kv.single_type_manager import MambaManager, SingleTypeManager

LEASE_MARGIN_S = 0.25


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Read `params.remote_block_ids` into `block_ids` (local, one list per cache group)."""

    req_id: str
    params: KVTransferParams
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    loads: tuple[LoadSpec, ...] = ()
    # (prefill agent, request id): tell a prefill side its blocks will never be read, so it
    # frees them now instead of at lease expiry (the decode side aborted or rejected).
    notify: tuple[tuple[str, str], ...] = ()


class NixlSchedulerConnector:
    def __init__(
        self, managers: Sequence[SingleTypeManager], lease_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.managers = tuple(managers)
        self.lease_s = lease_s
        self.clock = clock
        self._loads: list[LoadSpec] = []
        self._notify: list[tuple[str, str]] = []

    # -- decode side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, params: KVTransferParams | None, num_local_computed: int) -> tuple[int, bool]:
        """Tokens the remote KV supplies beyond the local prefix-cache hit, and whether they
        load asynchronously (they always do: the request waits for the transfer)."""
        if params is None:
            return 0, False
        return max(0, params.num_tokens - num_local_computed), True

    def lease_ok(self, params: KVTransferParams) -> bool:
        """Whether the prefill side still holds the pages, with a margin. Asked before a READ
        starts (one that cannot finish in time is never posted) and again when it has ended:
        a READ that ends near or after the deadline may have copied pages already reused."""
        return self.clock() < params.expires_at - LEASE_MARGIN_S

    def update_state_after_alloc(
        self,
        req_id: str,
        params: KVTransferParams,
        block_ids: Sequence[Sequence[int]],
        num_local_computed: int,
        num_external: int,
        checkpoint_ids: Sequence[int] = (),
    ) -> None:
        """Plan the READ of tokens [local, local + external) into the request's blocks: in each
        group the blocks holding those tokens (a local hit is block aligned, so the remote
        blocks before it are skipped block for block; a state group reads its one slot, the
        remote's state after its last computed token). `checkpoint_ids`, one local page per
        state group, also read the remote's state checkpoint (docs/design.md §21)."""
        end = num_local_computed + num_external
        spans = [manager.block_span(num_local_computed, end) for manager in self.managers]
        local = [tuple(mine[span]) for mine, span in zip(block_ids, spans)]
        sliced = params.sliced(spans)
        if checkpoint_ids:
            remote = list(sliced.remote_block_ids)
            states = [g for g, m in enumerate(self.managers) if isinstance(m, MambaManager)]
            for g, mine, theirs in zip(states, checkpoint_ids, params.checkpoint_block_ids, strict=True):
                local[g] += (mine,)
                remote[g] += (theirs,)
            sliced = dataclasses.replace(sliced, remote_block_ids=tuple(remote))
        self._loads.append(LoadSpec(req_id, sliced, tuple(local)))

    def notify_abandoned(self, params: KVTransferParams) -> None:
        self._notify.append((params.remote_agent_name, params.request_id))

    def build_connector_meta(self) -> ConnectorMetadata | None:
        if not self._loads and not self._notify:
            return None
        meta = ConnectorMetadata(tuple(self._loads), tuple(self._notify))
        self._loads, self._notify = [], []
        return meta

    @property
    def has_pending_meta(self) -> bool:
        return bool(self._loads or self._notify)

    # -- prefill side -----------------------------------------------------------------

    def lease_deadline(self) -> float:
        """When a lease granted now ends."""
        return self.clock() + self.lease_s

    def describe(
        self,
        req_id: str,
        engine_id: str,
        agent_name: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        checksums: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None,
    ) -> KVTransferParams:
        """Where a computed prompt's KV lies, under a lease that starts now; `checksums`
        (--kv-verify) go with it: per prefill rank, decode rank and group, one per block."""
        sums = None if checksums is None else tuple(tuple(tuple(tuple(g) for g in t) for t in row) for row in checksums)
        return KVTransferParams(
            engine_id, agent_name, tuple(tuple(b) for b in block_ids), num_tokens, req_id, self.lease_deadline(), sums
        )
