"""The token counts a penalized request's sampling reads, kept on the worker's device.

Presence, frequency and repetition penalties need, per request, how often each vocabulary
token is among its outputs and whether it is in its prompt. Rebuilding that from token lists
every step would cost a scatter over every request's whole history; instead each penalized
request owns one row of a pool, filled once from its prompt (and, for a request resumed on
another engine, the outputs it already had) and bumped by one scatter per step with the
tokens the step sampled. Unpenalized requests own no row: the default path costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Row 0 stays empty: the row of every unpenalized request in a gathered batch.
        self._counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
        self._prompt = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self._rows: dict[str, int] = {}
        self._free: list[int] = []

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def add(self, req_id: str, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        """Give a request a row: its prompt's tokens marked, its outputs (if any) counted."""
        if req_id in self._rows:
            raise ValueError(f"request {req_id!r} already has token counts")
        if not self._free:
            self._grow()
        row = self._rows[req_id] = self._free.pop()
        self._counts[row].zero_()
        self._prompt[row].zero_()
        self._prompt[row, torch.tensor(list(prompt), dtype=torch.long, device=self.device)] = True
        if outputs:
            ids = torch.tensor(list(outputs), dtype=torch.long, device=self.device)
            self._counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def remove(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def gather(self, req_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [R, V] int32, prompt mask [R, V] bool) of a batch's rows; all zero
        for a request without a row."""
        rows = torch.tensor([self._rows.get(r, 0) for r in req_ids], dtype=torch.long, device=self.device)
        return self._counts[rows], self._prompt[rows]

    def record(self, req_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """Count each request's newly sampled token (requests without a row are skipped)."""
        if not self._rows:
            return  # no penalized request: the common step does nothing here
        pairs = [(self._rows[r], t) for r, t in zip(req_ids, tokens, strict=True) if r in self._rows]
        if not pairs:
            return
        rows = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        cols = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        self._counts.index_put_((rows, cols), torch.ones_like(rows, dtype=torch.int32), accumulate=True)

    def _grow(self) -> None:
        """Double the pool; its size is bounded by the requests running at once."""
        old = self._counts.shape[0]
        self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
        self._prompt = torch.cat([self._prompt, torch.zeros_like(self._prompt)])
        self._free.extend(range(2 * old - 1, old - 1, -1))
