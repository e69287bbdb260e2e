"""Where a request's time goes inside one engine, as vLLM's request-phase histograms split it:

- queue: from arrival to the first step that computes any of its tokens (on a decode engine
  this includes waiting for its KV to load; the load itself is timed by the connector);
- prefill: from that step to the first token out (a prefill engine: to the hand-over);
- decode: from the first token to the last (not on a prefill engine, which decodes nothing).

Only requests that finish normally (stop or length) are observed, so aborts and failures do not
skew the numbers. The engine loop calls in; nothing here touches the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.messages import OutputBatch
from kv.nixl.transfer_stats import PHASE_BUCKETS, Histogram

PHASES = ("queue", "prefill", "decode")


@dataclass(slots=True)
class _Marks:
    arrival: float
    started: float | None = None
    first_token: float | None = None


@dataclass(slots=True)
class RequestPhases:
    clock: Callable[[], float] = time.monotonic
    histograms: dict[str, Histogram] = field(default_factory=lambda: {p: Histogram(PHASE_BUCKETS) for p in PHASES})
    _marks: dict[str, _Marks] = field(default_factory=dict)
    # The requests not yet started, and those started with no token out yet: each step looks
    # only at these, not at every running request.
    _unstarted: dict[str, _Marks] = field(default_factory=dict)
    _no_token: dict[str, _Marks] = field(default_factory=dict)

    def arrived(self, req_id: str) -> None:
        self._marks[req_id] = self._unstarted[req_id] = _Marks(self.clock())

    def scheduled(self, num_scheduled_tokens: Mapping[str, int]) -> None:
        if not self._unstarted:
            return
        now = self.clock()
        unstarted = self._unstarted
        if len(unstarted) < len(num_scheduled_tokens):  # whichever is shorter: a long queue, or a big batch
            started = [r for r in unstarted if num_scheduled_tokens.get(r)]
        else:
            started = [r for r, n in num_scheduled_tokens.items() if n and r in unstarted]
        for req_id in started:
            marks = self._no_token[req_id] = unstarted.pop(req_id)
            marks.started = now

    def outputs(self, batch: OutputBatch) -> None:
        now = self.clock()
        if self._no_token:
            for req_id in batch.req_ids:
                marks = self._no_token.pop(req_id, None)
                if marks is not None:
                    marks.first_token = now
        for out in batch.others:
            marks = self._marks.get(out.req_id)
            if marks is None:
                continue
            if marks.first_token is None and (out.new_token_ids or out.kv_transfer_params):
                marks.first_token = now
                self._no_token.pop(out.req_id, None)
            if out.finish_reason is None:
                continue
            del self._marks[out.req_id]
            self._unstarted.pop(out.req_id, None)
            self._no_token.pop(out.req_id, None)
            if out.finish_reason not in ("stop", "length") or marks.started is None or marks.first_token is None:
                continue
            self.histograms["queue"].observe(marks.started - marks.arrival)
            self.histograms["prefill"].observe(marks.first_token - marks.started)
            if out.kv_transfer_params is None:
                self.histograms["decode"].observe(now - marks.first_token)

    def snapshot(self) -> dict[str, Histogram]:
        return {p: h.copy() for p, h in self.histograms.items()}
