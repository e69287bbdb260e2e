"""Where a prefill engine left a request's KV: the message a decode engine needs to pull it.

Who makes them and who trusts them: a prefill engine's scheduler builds them from its own
block tables (engine/pd.py) and answers the request with them; they stay this typed object
through the ingress (the output channel or a Ray call) to the decode engine, whose connector
READs the pages. They never come from an HTTP client: the API has no such field and refuses
one by name. The processes they cross are raypd's own, but two engines may run different
builds, and a wrong block id would make a READ copy another request's pages; so they are
checked once, with `validate`, where they enter the decode engine (`EngineCore.add_request`),
and a bad one is refused as an invalid request.

The prefill engine keeps the pages only under a lease; `expires_at` (wall-clock seconds, the
prefill side's clock) travels with them so the decode side never trusts a READ that may have
raced the lease's free: see `NixlSchedulerConnector.lease_ok`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# --kv-verify: [prefill rank][decode rank][cache group][block] -> the checksum of the bytes of
# that block that decode rank READs from that prefill rank (kv/nixl/verify.py, kv/nixl/tp_slices.py).
Checksums = tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    remote_engine_id: str
    remote_agent_name: str  # the prefill worker's NIXL agent, also where the notification goes
    remote_block_ids: tuple[tuple[int, ...], ...]  # one tuple per cache group, prefill-side ids
    num_tokens: int  # tokens whose KV / state the transfer supplies
    request_id: str  # the prefill side's id: the notification names it so its blocks are freed
    expires_at: float = float("inf")  # when the prefill side frees the pages unread (time.time())
    # --kv-verify: per (prefill rank, decode rank) one checksum per block of `remote_block_ids`
    # (`Checksums`); None without it
    page_checksums: Checksums | None = None
    # Hybrid prefix caching (docs/design.md §21): a state checkpoint of the prompt, the state
    # after its first `checkpoint_tokens` tokens, one prefill-side page per state group, that the
    # decode side may load beside the prompt and cache; 0 and () when there is none.
    checkpoint_tokens: int = 0
    checkpoint_block_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        """Raises ValueError naming the first field of the wrong type or range."""
        for name in ("remote_engine_id", "remote_agent_name", "request_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not _is_int(self.num_tokens) or self.num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {self.num_tokens!r}")
        if not isinstance(self.remote_block_ids, tuple) or not all(
            isinstance(group, tuple) and all(_is_int(b) and b >= 0 for b in group) for group in self.remote_block_ids
        ):
            raise ValueError(f"remote_block_ids must be tuples of non-negative ints, got {self.remote_block_ids!r}")
        if (
            not isinstance(self.expires_at, int | float)
            or isinstance(self.expires_at, bool)
            or self.expires_at != self.expires_at
        ):
            raise ValueError(f"expires_at must be a number of seconds, got {self.expires_at!r}")
        if not _is_int(self.checkpoint_tokens) or not 0 <= self.checkpoint_tokens <= self.num_tokens:
            raise ValueError(f"checkpoint_tokens must be an int in [0, num_tokens], got {self.checkpoint_tokens!r}")
        if not isinstance(self.checkpoint_block_ids, tuple) or not all(
            _is_int(b) and b >= 0 for b in self.checkpoint_block_ids
        ):
            raise ValueError(f"checkpoint_block_ids must be non-negative ints, got {self.checkpoint_block_ids!r}")
        if self.page_checksums is not None and not _shaped(self.page_checksums, self.remote_block_ids):
            raise ValueError(
                "page_checksums must be, per prefill rank and decode rank, ints shaped like remote_block_ids, "
                f"got {self.page_checksums!r}"
            )

    def sliced(self, spans: list[slice]) -> KVTransferParams:
        """The same transfer, reduced to these blocks of each group (with their checksums)."""
        sums = self.page_checksums
        return dataclasses.replace(
            self,
            remote_block_ids=tuple(ids[s] for ids, s in zip(self.remote_block_ids, spans)),
            page_checksums=None
            if sums is None
            else tuple(tuple(tuple(g[s] for g, s in zip(groups, spans)) for groups in row) for row in sums),
        )


def _is_int(value: object) -> bool:
    # JSON true/false parse to bool, which is an int subclass; a block id is never a bool.
    return isinstance(value, int) and not isinstance(value, bool)


def _shaped(sums: Any, blocks: tuple[tuple[int, ...], ...]) -> bool:
    shape = [len(g) for g in blocks]
    return (
        isinstance(sums, tuple)
        and len(sums) > 0
        and all(isinstance(row, tuple) and len(row) == len(sums[0]) > 0 for row in sums)
        and all(
            isinstance(groups, tuple)
            and [len(g) if isinstance(g, tuple) else -1 for g in groups] == shape
            and all(_is_int(c) for g in groups for c in g)
            for row in sums
            for groups in row
        )
    )
