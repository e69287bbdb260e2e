"""A prompt's full blocks as the engines' prefix caches name them, computed on the ingress.

The same chained block hashing as the engines (kv/block_hash.py) and the same truncation as
their summaries (engine/summary.py), so "engine E holds the first k blocks of this prompt" is
a set lookup per block. Like the engines' own lookup, at most `len(prompt) - 1` tokens can hit:
the last prompt token is always computed, since its logits give the first output token.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.summary import digest_of
from kv.block_hash import extend_block_hashes


class PromptBlocks:
    """One prompt's block digests, per block size (engines of one fleet may differ), each
    computed once however many engines are scored."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._digests: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def digests(self, block_size: int) -> list[int]:
        if block_size not in self._digests:
            hittable = self.token_ids[: (len(self.token_ids) - 1) // block_size * block_size]
            self._digests[block_size] = [digest_of(h) for h in extend_block_hashes([], hittable, block_size)]
        return self._digests[block_size]

    def hit_tokens(self, cached: frozenset[int], block_size: int, checkpoints: frozenset[int] | None = None) -> int:
        """Tokens of the longest run of leading blocks found in `cached`; with `checkpoints` (a
        hybrid model), only up to the last of them a state checkpoint follows."""
        digests = self.digests(block_size)
        n = 0
        for digest in digests:
            if digest not in cached:
                break
            n += 1
        if checkpoints is not None:
            while n and digests[n - 1] not in checkpoints:
                n -= 1
        return n * block_size
