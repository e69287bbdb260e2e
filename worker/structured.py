"""A worker's structured outputs: its grammar compiler, each request's matcher, each step's mask.

Built on the first request that has a grammar: importing xgrammar imports transformers (its
tokenizer module does), which a worker that never serves such a request does not need. A step
whose requests have no grammar costs one look at each sampled row's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.messages import NewRequestData

if TYPE_CHECKING:
    from worker.grammar import GrammarCompiler
    from worker.grammar_mask import GrammarMask, RequestGrammar


class InvalidGrammarError(ValueError):
    """The request's schema, regex or grammar cannot be compiled. The text starts with
    `INVALID_GRAMMAR`, by which the API answers 400 naming the request's field."""


class StructuredOutputs:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_id: int | None) -> None:
        """`vocab_size`: the logits' width, which the masks cover (padding rows included)."""
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._compiler: GrammarCompiler | None = None
        self._mask: GrammarMask | None = None

    def prefetch(self, new_reqs: Sequence[NewRequestData]) -> None:
        """Start compiling the grammars of a step's new requests before the step runs."""
        for new in new_reqs:
            if new.sampling.structured is not None:
                self._compilers().prefetch(new.sampling.structured)

    def matcher(self, new: NewRequestData, num_prompt: int) -> RequestGrammar | None:
        """The new request's matcher, its grammar advanced by its outputs so far (the prompt's
        tokens past `num_prompt`: a resumed request's earlier outputs); None without a grammar.
        Raises InvalidGrammarError, or ValueError when those outputs break the grammar."""
        structured = new.sampling.structured
        if structured is None:
            return None
        from worker.grammar_mask import RequestGrammar

        if not 0 <= num_prompt <= len(new.prompt_token_ids):
            raise ValueError(f"{len(new.prompt_token_ids) - num_prompt} earlier outputs in a prompt of fewer tokens")
        return RequestGrammar(self._compilers().get(structured), new.prompt_token_ids[num_prompt:])

    def mask(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
        """Mask the rows of `logits` that have a grammar; the others are left untouched."""
        if not any(g is not None for g in grammars):
            return
        if self._mask is None:
            from worker.grammar_mask import GrammarMask

            self._mask = GrammarMask(self._vocab_size)
        self._mask.apply(logits, grammars)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()

    def _compilers(self) -> GrammarCompiler:
        if self._compiler is None:
            from worker.grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self._model_dir, self._vocab_size, self._eos_token_id)
        return self._compiler


def failure(error: Exception) -> str:
    """Why a request's grammar could not be set up, as the request's error text."""
    if isinstance(error, InvalidGrammarError):
        return str(error)
    return f"its grammar could not be set up: {error!r}"
