"""A request's grammar state on the worker, and the token mask of a step's batch.

A request's matcher is its compiled grammar advanced by the request's output tokens so far.
It is built that way when the worker first sees the request, whatever came before: a fresh
request has no outputs; one resumed on another engine after its own was lost carries its
earlier outputs as the end of its prompt (`SamplingParams.num_prior_outputs`, api/migration.py),
which are replayed. From then on it is advanced by each token the worker samples for the
request. A preempted request keeps its worker state, its matcher with it, and is recomputed
from its token list; a prefill engine's token is no output (engine/pd.py), so a decode worker
starts from the prompt as any other. The mask is applied where tokens are sampled because
under async scheduling only the worker knows a request's newest token when the next step
samples (docs/design.md §17).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class RequestGrammar:
    """One request's matcher."""

    def __init__(self, compiled: xgr.CompiledGrammar, outputs: Sequence[int]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(outputs):
            if not self._matcher.accept_token(token):
                raise ValueError(f"output token {i} ({token}) does not follow the request's grammar")

    @property
    def terminated(self) -> bool:
        """It took EOS: the engine ends the request on it, and anything sampled for it after
        that (a step scheduled before the EOS was known) is dropped there."""
        return bool(self._matcher.is_terminated())

    def accept(self, token: int) -> bool:
        """Advance by the token sampled; False if the grammar refuses it (the mask allowed no
        token, or the sampler broke it)."""
        return self.terminated or bool(self._matcher.accept_token(token))

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        return self._matcher


class GrammarMask:
    """One bitmask for a step's rows: the rows with a live grammar filled (on xgrammar's
    threads), applied to the logits in one call; the other rows are left as they are."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # host memory: xgrammar fills it there
        self._batch = xgr.BatchGrammarMatcher()

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
        """Mask `logits` [R, V] in place: row i may only take what `grammars[i]` allows next."""
        live = [(i, g.matcher) for i, g in enumerate(grammars) if g is not None and not g.terminated]
        if not live:
            return
        rows = [i for i, _ in live]
        if self._bitmask.shape[0] < len(grammars):
            self._bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        bitmask = self._bitmask[: len(grammars)]
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, rows)
        if logits.device != bitmask.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
