"""The block-table unit shared by the scheduler and the worker.

Torch-free on purpose: the engine and API processes size and schedule KV blocks with these
and never load torch (docs/design.md §14).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of size `b` that `a` tokens take."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """Layers that share one block table: the i-th block of a request means the same page
    index for every layer of the group."""

    kind: Literal["attention", "mamba"]
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("attention", "mamba"):
            raise ValueError(f"unknown cache group kind {self.kind!r}")
