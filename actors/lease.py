"""Lease heartbeats: the decode side renews the leases of the KV it still has to read.

A prefill engine holds a handed-over request's blocks under a short lease (`--kv-lease-s`),
so that a decode side that dies or stalls strands them for seconds, not minutes. A decode
engine whose request waits longer than that (queued behind others, or its READ in flight)
renews the lease every `interval_s` by asking the prefill engine directly: the renewal is
a call with an answer, because only a deadline the prefill side has granted may be trusted.
A renewal that is lost or refused (the prefill side already freed the blocks, or is gone)
changes nothing here: the old deadline stands, and `lease_ok` turns the load into a failed
one when it passes, so a late reader never reads pages that may have been reused
(docs/design.md §6, §12).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

log = logging.getLogger(__name__)

# (prefill engine id, its request ids) -> the new deadline of each id it still holds
Renew = Callable[[str, list[str]], Awaitable[Mapping[str, float]]]


class LeaseHolder(Protocol):
    """The decode scheduler's side of a renewal."""

    def leases_to_renew(self) -> dict[str, dict[str, str]]: ...

    def lease_renewed(self, deadlines: Mapping[str, float]) -> None: ...


class LeaseRenewer:
    def __init__(self, holder: LeaseHolder, renew: Renew, interval_s: float, timeout_s: float | None = None) -> None:
        """`timeout_s` bounds one renewal call (default: two beats); a late answer is still
        good, since the deadline it grants is absolute, so it may be as long as a lease."""
        if interval_s <= 0 or (timeout_s is not None and timeout_s <= 0):
            raise ValueError(f"interval_s and timeout_s must be positive, got {interval_s}, {timeout_s}")
        self.holder = holder
        self.renew = renew
        self.interval_s = interval_s
        self.timeout_s = timeout_s or 2 * interval_s
        self.num_renewed = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.renew_once()

    async def renew_once(self) -> int:
        """Renew every lease a waiting request needs; the number the prefill sides granted."""
        wanted = self.holder.leases_to_renew()
        answers = await asyncio.gather(*(self._ask(engine, list(ids)) for engine, ids in wanted.items()))
        granted = 0
        for ids, answer in zip(wanted.values(), answers):
            local = {ids[remote]: deadline for remote, deadline in answer.items() if remote in ids}
            self.holder.lease_renewed(local)
            granted += len(local)
        self.num_renewed += granted
        return granted

    async def _ask(self, engine_id: str, remote_ids: list[str]) -> Mapping[str, float]:
        # A prefill engine that does not answer in time is treated as one that refused, and
        # its lease runs out on its own.
        try:
            return await asyncio.wait_for(self.renew(engine_id, remote_ids), self.timeout_s)
        except Exception as e:
            log.warning("could not renew %d KV leases at %s: %r", len(remote_ids), engine_id, e)
            return {}
