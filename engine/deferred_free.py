"""Freed blocks wait for the last step that used them (docs/design.md §3).

Under async scheduling a request can finish or be preempted while a step that writes its
blocks is still running; if those blocks went straight back to the pool they could be handed
to a remote load whose bytes land first and are then overwritten by the stale step. So a
request's blocks are freed only once the step it last ran in has reported back.
"""

from __future__ import annotations

from kv.kv_cache_manager import KVCacheManager


class DeferredFree:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.last_reported = -1  # the newest step whose result has been applied
        self._pending: list[tuple[int, str]] = []  # (fence step, request id)
        self._ids: set[str] = set()

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._ids

    def __len__(self) -> int:
        """Requests whose blocks wait for a step in flight."""
        return len(self._pending)

    def release(self, req_id: str, last_step: int) -> bool:
        """Free the request's blocks now if no step in flight uses them (True), else at the fence."""
        if last_step <= self.last_reported:
            self.kv.free(req_id)
            return True
        if req_id not in self._ids:
            self._pending.append((last_step, req_id))
            self._ids.add(req_id)
        return False

    def reported(self, step: int) -> None:
        """Step `step` has reported: free everything fenced on it or earlier."""
        self.last_reported = step
        if not self._pending:
            return
        keep = []
        for fence, req_id in self._pending:
            if fence <= step:
                self.kv.free(req_id)
                self._ids.discard(req_id)
            else:
                keep.append((fence, req_id))
        self._pending = keep
