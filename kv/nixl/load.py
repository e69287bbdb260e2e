"""One KV load on the decode side (kv/nixl/worker.py): which local blocks it writes from which
remote ranks, what its READs moved, and which of its blocks are invalid once it ends.

A load writes every local block it names, group by group; a block left unread (a failed or
refused READ, an injected failure: kv/nixl/load_faults.py) or one whose bytes fail their
`--kv-verify` checksums (kv/nixl/load_verify.py) is reported in `failed`, so the scheduler's
load-failure policy decides (docs/design.md §12).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv.nixl.read_descs import Pairs

# --kv-verify: (remote rank, remote TP size) -> (kind, local block, checksum) of each block read
Expected = dict[tuple[int, int], list[tuple[str, int, int]]]


@dataclass(slots=True)
class Load:
    block_ids: list[int]  # every local block the load writes, in group order
    skipped: list[int]  # local blocks left unread: reported as failed
    # Every remote rank this rank reads from or must notify: (agent, notification message).
    targets: list[tuple[str, str]] = field(default_factory=list)
    kept: Pairs = field(default_factory=list)  # (local, remote) block pairs to READ
    # One READ per remote rank read from (agent -> handle), each carrying its notification;
    # empty when nothing is in flight.
    handles: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0  # time.monotonic() when the READs were posted
    num_descs: int = 0  # descriptors the READs move
    num_bytes: int = 0
    deadline: float = float("inf")  # time.monotonic() past which the load fails (timeout)
    post_at: float | None = None  # fault injection: the READs held back until then
    expected: Expected = field(default_factory=dict)  # --kv-verify

    def fail(self) -> None:
        """Every block of the load is invalid."""
        self.skipped = list(self.block_ids)

    def read_blocks(self) -> list[int]:
        skipped = set(self.skipped)
        return [b for b in self.block_ids if b not in skipped]


def pair_blocks(
    local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], num_blocks: int, remote_num_blocks: int
) -> Pairs:
    """(local, remote) block pairs per group, validated."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local block lists for {len(remote)} remote cache groups")
    pairs: Pairs = []
    seen: set[int] = set()
    for g, (mine, theirs) in enumerate(zip(local, remote)):
        if len(theirs) > len(mine):
            raise ValueError(f"group {g}: {len(theirs)} remote blocks do not fit in {len(mine)} local ones")
        group = [(int(a), int(b)) for a, b in zip(mine, theirs)]
        for a, b in group:
            if not 0 <= a < num_blocks or not 0 <= b < remote_num_blocks:
                raise ValueError(
                    f"group {g}: block pair ({a}, {b}) out of range "
                    f"({num_blocks} local, {remote_num_blocks} remote blocks)"
                )
            if a in seen:
                raise ValueError(f"local block {a} is written twice by one load")
            seen.add(a)
        pairs.append(group)
    return pairs
