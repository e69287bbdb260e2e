"""Batched sampling with per-request parameters and per-request random streams.

Every non-greedy request owns a `torch.Generator`, so the tokens a seeded request gets
depend only on its seed and its own logits, never on which other requests share the
batch or in what order. Filtering (temperature, top-k, top-p) runs on the whole batch;
only the random draw is per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.messages import SamplingParams

_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log_softmax of the unscaled logits at the chosen token


class Sampler:
    """Samples one token per row of fp32 logits [R, V].

    Unseeded requests get a seed derived from the worker's seed and a counter of the
    generators handed out, so a worker started with the same seed and fed the same
    requests in the same order (every tensor-parallel rank is) draws the same tokens."""

    def __init__(self, seed: int, device: torch.device | str, vocab_size: int | None = None) -> None:
        """`vocab_size`: the logits' width, which a draw's size is (see `generator_for`)."""
        self.seed = seed
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self._count = 0

    def generator_for(self, params: SamplingParams) -> torch.Generator | None:
        """A fresh random stream for a new request; None for greedy requests, which need none."""
        if params.greedy:
            return None
        seed = params.seed
        if seed is None:
            seed = (self.seed * 1_000_003 + self._count) & _SEED_MASK
            self._count += 1
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        if params.random_offset:
            if self.vocab_size is None:
                raise ValueError("resuming a random stream needs the sampler's vocab_size")
            # Exactly the draws `_draw` made for the tokens already sampled: one row of noise each.
            for _ in range(params.random_offset):
                torch.empty(self.vocab_size, dtype=torch.float32, device=self.device).exponential_(generator=gen)
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        want_logprobs: bool = False,
    ) -> SampleResult:
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params / {len(generators)} generators"
            )
        tokens = logits.argmax(dim=-1)
        rows = [r for r, p in enumerate(params) if not p.greedy]
        if rows:
            probs = filtered_probs(logits[rows], [params[r] for r in rows])
            for i, r in enumerate(rows):
                gen = generators[r]
                if gen is None:
                    raise ValueError(f"row {r} samples with temperature {params[r].temperature} but has no generator")
                tokens[r] = _draw(probs[i], gen)
        logprobs = None
        if want_logprobs:
            chosen = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
            logprobs = chosen.tolist()
        return SampleResult(tokens.tolist(), logprobs)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, for rows that all sample (temperature > 0)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temps[:, None]
    if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
        return scaled.softmax(dim=-1)  # nothing to filter: skip sorting the vocabulary
    vocab = logits.shape[1]
    top_k = torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(ordered.shape[1], device=device)
    ordered = ordered.masked_fill((top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None]), float("-inf"))
    probs = ordered.softmax(dim=-1)
    # Drop a token once the mass ranked above it already reaches top_p; the first always stays.
    above = probs.cumsum(dim=-1) - probs
    drop = (above >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw from `probs` as argmax(p / Exp(1)): the same law as multinomial, but stale NaN
    logits yield some token instead of an exception that would fail the whole step."""
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return (probs / noise).argmax()
