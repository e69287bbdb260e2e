"""Batched sampling with per-request parameters and per-request random streams.

Every non-greedy request owns a `torch.Generator`, so the tokens a seeded request gets
depend only on its seed and its own logits, never on which other requests share the
batch or in what order. Filtering (temperature, top-k, top-p) runs on the whole batch;
only the random draw is per row.

The order is vLLM's: logprobs are taken from the raw logits; then min_tokens masks the stop
tokens, the logit bias is added, and the penalties apply (repetition over prompt and
outputs, frequency and presence over outputs), all before the greedy argmax; temperature,
then min_p, then top-k and top-p shape what is drawn. A batch in which no request uses a
knob past top-k/top-p pays for none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.messages import SamplingParams, TopLogprobs

_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log_softmax of the unscaled logits at the chosen token
    # Per row, the batch's largest `top_logprobs` alternatives (None when no row asks).
    top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What the rows' penalties and min_tokens read: the worker's count of each request's
    tokens, as [R, V] tensors on the logits' device (None when no row is penalized)."""

    output_counts: torch.Tensor | None  # int: how often each token is among the outputs
    prompt_mask: torch.Tensor | None  # bool: the token is in the prompt
    num_outputs: Sequence[int]  # outputs so far, per row (min_tokens)
    eos_token_id: int | None  # masked with `stop_token_ids` before min_tokens, unless ignore_eos


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
        history: TokenHistory | None = None,
    ) -> SampleResult:
        """`history` is needed when a row `adjusts_logits`; `want_logprobs` gives every row its
        token's logprob and the alternatives the rows ask for."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params / {len(generators)} generators"
            )
        raw = logits
        if any(p.adjusts_logits for p in params):
            if history is None:
                raise ValueError("a row adjusts its logits (penalties, bias, min_tokens) but no history was given")
            logits = adjusted_logits(logits, params, history)
        tokens = logits.argmax(dim=-1)
        rows = [r for r, p in enumerate(params) if not p.greedy]
        if rows:
            probs = filtered_probs(logits[rows], [params[r] for r in rows])
            for i, r in enumerate(rows):
                gen = generators[r]
                if gen is None:
                    raise ValueError(f"row {r} samples with temperature {params[r].temperature} but has no generator")
                tokens[r] = _draw(probs[i], gen)
        if not want_logprobs:
            return SampleResult(tokens.tolist(), None)
        top_n = max((p.top_logprobs for p in params if p.logprobs), default=0)
        logprobs, top = logprobs_of(raw, tokens, top_n)
        return SampleResult(tokens.tolist(), logprobs, top if top_n else None)


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> tuple[list[float], list[TopLogprobs]]:
    """Per row of raw logits [R, V]: log_softmax at its target token, and its `top_n` most
    likely tokens (empty lists for 0). One log_softmax and one topk for the whole batch."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    if not top_n:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def adjusted_logits(logits: torch.Tensor, params: Sequence[SamplingParams], history: TokenHistory) -> torch.Tensor:
    """min_tokens, logit bias and penalties, in vLLM's order, on a float copy of `logits`. The
    Python loops run over each row's few stop ids and biases, never over the vocabulary."""
    out = logits.float().clone()
    device = out.device
    rows: list[int] = []
    cols: list[int] = []
    for r, p in enumerate(params):
        if p.min_tokens > history.num_outputs[r]:
            ids = list(p.stop_token_ids)
            if history.eos_token_id is not None and not p.ignore_eos:
                ids.append(history.eos_token_id)
            rows += [r] * len(ids)
            cols += ids
    if rows:
        out[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    bias_rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    if bias_rows:
        index = (
            torch.tensor(bias_rows, device=device),
            torch.tensor([t for p in params for t, _ in p.logit_bias], device=device),
        )
        bias = torch.tensor([b for p in params for _, b in p.logit_bias], dtype=torch.float32, device=device)
        out.index_put_(index, bias, accumulate=True)
    if any(p.penalized for p in params):
        counts, prompt_mask = history.output_counts, history.prompt_mask
        if counts is None or prompt_mask is None:
            raise ValueError("a row is penalized but the history has no token counts")

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        in_outputs = counts > 0
        repetition = per_row([p.repetition_penalty for p in params])
        scale = torch.where(prompt_mask | in_outputs, repetition, 1.0)
        out = torch.where(out > 0, out / scale, out * scale)
        out -= per_row([p.frequency_penalty for p in params]) * counts
        out -= per_row([p.presence_penalty for p in params]) * in_outputs
    return out


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min_p, top-k and top-p, for rows that all sample (temperature > 0)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        # A token less likely than min_p times the most likely one is dropped (vLLM's min_p).
        probs = scaled.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)[:, None]
        scaled = scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
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
