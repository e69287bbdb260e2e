"""The decode side's lease heartbeat: granted deadlines reach the right requests; a prefill
engine that refuses, fails or does not answer in time changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from actors.lease import LeaseRenewer


class Holder:
    """The two calls `LeaseRenewer` makes of a decode scheduler, recorded."""

    def __init__(self, wanted: dict[str, dict[str, str]]) -> None:
        self.wanted = wanted
        self.renewed: dict[str, float] = {}

    def leases_to_renew(self) -> dict[str, dict[str, str]]:
        return self.wanted

    def lease_renewed(self, deadlines: Mapping[str, float]) -> None:
        self.renewed.update(deadlines)


def test_granted_deadlines_reach_the_local_requests_and_failures_change_nothing():
    holder = Holder({"pre-0": {"p1": "d1", "p2": "d2"}, "pre-1": {"p3": "d3"}, "pre-2": {"p4": "d4"}})

    async def renew(engine_id: str, ids: list[str]) -> dict[str, float]:
        if engine_id == "pre-1":
            raise ConnectionError("the prefill engine died")
        if engine_id == "pre-2":
            await asyncio.sleep(10)  # never answers within the beat
        return {"p1": 100.0, "elsewhere": 5.0}  # p2 is no longer held; an id never asked is ignored

    renewer = LeaseRenewer(holder, renew, interval_s=0.05)
    assert asyncio.run(renewer.renew_once()) == 1
    assert holder.renewed == {"d1": 100.0}


def test_interval_is_validated():
    with pytest.raises(ValueError, match="interval_s"):
        LeaseRenewer(Holder({}), lambda e, ids: asyncio.sleep(0, {}), interval_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        LeaseRenewer(Holder({}), lambda e, ids: asyncio.sleep(0, {}), interval_s=1, timeout_s=-1)
