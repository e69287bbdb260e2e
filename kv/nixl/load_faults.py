"""Test faults in a decode worker's KV loads (kv/nixl/worker.py; off by default).

With probability `fail_fraction` (seeded, one draw per `start_load`) a load READs only the
first half, rounded down, of each group's blocks, notifying as usual; the rest keep their
old bytes and are reported in `failed`, as a transfer that broke off would leave them. A
one-block group (a Mamba state) is not read at all; if nothing is read, no transfer is
posted and the notification goes alone. `delay_s` holds every READ back that long before
posting it, as a stalled peer or link would; past the timeout it is a READ that never
completes. With probability `corrupt_fraction` a landed load's first block has its pages'
bits flipped, which only `--kv-verify` (`page_checksums`, kv/nixl/verify.py) detects: the block
is then reported failed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from kv.nixl.read_descs import Pairs
from kv.nixl.verify import corrupt


class LoadFaults:
    """One connector's faults; its draws come from one seeded generator, in call order.
    Not thread-safe: the connector's lock guards it."""

    def __init__(self, fail_fraction: float, corrupt_fraction: float, delay_s: float, seed: int) -> None:
        self.fail_fraction = fail_fraction
        self.corrupt_fraction = corrupt_fraction
        self.delay_s = delay_s
        self._rng = random.Random(seed)

    def kept(self, pairs: Pairs) -> Pairs:
        """The block pairs a load READs: all of them, or after a drawn failure the first half
        of each group."""
        failed = self.fail_fraction > 0.0 and self._rng.random() < self.fail_fraction
        return [group[: len(group) // 2] for group in pairs] if failed else pairs

    def maybe_corrupt(self, buffers: Sequence[torch.Tensor], read: Sequence[int]) -> None:
        """The first block READ goes bad after hand-over (on the way, or in memory)."""
        if read and self.corrupt_fraction > 0.0 and self._rng.random() < self.corrupt_fraction:
            corrupt(buffers, read[0])
