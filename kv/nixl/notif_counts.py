"""Counted notifications: a prefill rank read by several decode ranks learns a request was
read only once every one of them has notified (kv/nixl/worker.py).

Between engines of different TP sizes a remote rank may be read by n local ranks
(kv/nixl/tp_slices.py `readers`); each sends it the request id with n in the message
(`counted`), and the remote rank reports the request read once all n arrived. A plain id
(one reader, or a load the decode side abandoned) is reported at once.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

# Separates a request id from the number of notifications its blocks wait for (TP readers).
_COUNT_SEP = "\x1f"


def counted(req_id: str, readers: int) -> str:
    """The notification each of `readers` local ranks sends a remote rank for `req_id`."""
    return req_id if readers == 1 else f"{req_id}{_COUNT_SEP}{readers}"


class NotifCounts:
    """The prefill side's counts so far, and when each count's first notification came.
    Not thread-safe: the connector's lock guards it."""

    def __init__(self, transfer_timeout_s: float) -> None:
        self._timeout_s = transfer_timeout_s
        self._counts: dict[str, tuple[int, float]] = {}

    def __len__(self) -> int:
        """Requests whose reader notifications are only partly counted."""
        return len(self._counts)

    def on_notif(self, text: str) -> str | None:
        """A request id, or `id<SEP>n` when n readers (other TP ranks) each send one: the id
        once its blocks are read by all n, else None."""
        req_id, sep, count = text.rpartition(_COUNT_SEP)
        if not sep or not count.isdigit():
            return text
        seen, first = self._counts.pop(req_id, (0, time.monotonic()))
        if seen + 1 >= int(count):
            return req_id
        self._counts[req_id] = (seen + 1, first)
        return None

    def forget_stale(self, now: float) -> None:
        """Drop counts whose other notifications are overdue: a decode rank died mid-load. Its
        readers all start at one engine step and each ends within the transfer timeout, so
        past twice that none is coming; the request's blocks go at the end of its lease."""
        for req_id, (seen, first) in list(self._counts.items()):
            if now - first > 2 * self._timeout_s:
                log.warning("request %s: %d of its readers notified; the rest are overdue", req_id, seen)
                del self._counts[req_id]
