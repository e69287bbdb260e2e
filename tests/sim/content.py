"""What every KV page holds, symbolically, so a forward can check each entry it reads.

One pool serves every cache group (kv/cache_layout.py): block b is one page, used at a time
by one attention group (a slot per token position) or one Mamba group (a single state).
A page's content is therefore either a list of slots or a `State`:

- an attention slot holds `KV(group, h)`: the K/V of the last position of the token prefix
  whose hash is h (K/V at position p depends on all of tokens[:p+1]), or ZERO;
- a `State(group, h)` is a Mamba state after exactly the prefix with hash h;
- a state page read by an attention group is GARBAGE in every slot (stale fp32 state bits
  read as 16-bit K/V can be NaN), and stays GARBAGE in the slots nobody writes until the
  page is zeroed. A masked NaN still poisons the output (0 * NaN), so a forward must not
  find GARBAGE in any slot of a block it gathers. A dense model never has state pages, so
  it never produces GARBAGE.

Memory starts zeroed, as the real worker's does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mark(enum.Enum):
    ZERO = "zero"
    GARBAGE = "garbage"


@dataclass(frozen=True, slots=True)
class KV:
    group: int
    prefix: int


@dataclass(frozen=True, slots=True)
class State:
    group: int
    prefix: int


Slot = KV | Mark
Page = list[Slot] | State


def extend_prefix_hashes(hashes: list[int], tokens: list[int]) -> None:
    """hashes[p] identifies tokens[:p+1]; extend the chain to cover every token."""
    h = hashes[-1] if hashes else 0
    for tok in tokens[len(hashes) :]:
        h = hash((h, tok))
        hashes.append(h)


class Provenance:
    """Readable names for prefix hashes ("r7[:12]": request r7's first 12 tokens), shared by
    every engine of a run so a report can say whose content a page held instead."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}

    def name(self, prefix: int, req_id: str, length: int) -> None:
        self._names.setdefault(prefix, f"{req_id}[:{length}]")

    def describe(self, content: Slot | State) -> str:
        if isinstance(content, Mark):
            return content.value
        kind = "kv" if isinstance(content, KV) else "state"
        return f"{kind}(g{content.group}, {self._names.get(content.prefix, f'#{content.prefix & 0xFFFF:04x}')})"


class PageMemory:
    """One engine's pages."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pages: list[Page] = [self._zero_page() for _ in range(num_blocks)]

    @property
    def num_blocks(self) -> int:
        return len(self.pages)

    def _zero_page(self) -> list[Slot]:
        return [Mark.ZERO] * self.block_size

    def zero(self, block: int) -> None:
        self.pages[block] = self._zero_page()

    def read_slot(self, block: int, slot: int) -> Slot:
        page = self.pages[block]
        return Mark.GARBAGE if isinstance(page, State) else page[slot]

    def write_slot(self, block: int, slot: int, content: KV) -> None:
        page = self.pages[block]
        if isinstance(page, State):  # the rest of the page keeps the stale state's bits
            page = self.pages[block] = [Mark.GARBAGE] * self.block_size
        page[slot] = content

    def read_state(self, block: int) -> Page:
        page = self.pages[block]
        return page if isinstance(page, State) else list(page)

    def write_state(self, block: int, content: State) -> None:
        self.pages[block] = content

    def copy_page(self, src: PageMemory, src_block: int, dst_block: int) -> None:
        """A READ of one page: whatever the source holds at this moment."""
        page = src.pages[src_block]
        self.pages[dst_block] = page if isinstance(page, State) else list(page)


def describe_page(prov: Provenance, page: Page) -> str:
    if isinstance(page, State):
        return prov.describe(page)
    return "[" + ", ".join(prov.describe(s) for s in page) + "]"
