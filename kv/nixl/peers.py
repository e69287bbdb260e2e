"""The peers a NIXL worker reads from (kv/nixl/worker.py): what a peer tells it (`PeerInfo`),
and which of a remote engine's ranks a load reads from or notifies (`PeerTable`).

Tensor parallelism. Each rank of an engine has its own agent and registers its own shard;
`PeerInfo` names the rank and its engine's rank-0 agent (the one KVTransferParams carry).
Between engines of equal TP size rank d reads whole pages from rank d. Otherwise a rank
reads its head slices from every remote rank holding some (kv/nixl/tp_slices.py); a remote rank
read by n ranks is notified n times, the count in the message (kv/nixl/notif_counts.py).

Peers. A dead engine's agents are removed (its replacement has new agent names, never the
old ones): later loads naming them fail as from an unknown peer, and the names are never
accepted again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kv.nixl.compat import KVCompat
from kv.nixl.notif_counts import counted
from kv.nixl.read_descs import Pages
from kv.nixl.tp_slices import PageSlicer


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a peer needs to READ from this worker; the caller passes it through Ray."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes = field(repr=False)  # NIXL's own serialisation, not a pickle
    base_addrs: tuple[int, ...]  # one per buffer
    page_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    # Tensor parallelism: this worker's rank in its engine, and rank 0's agent name (the one
    # KVTransferParams carry); every rank's page holds only its share of the heads.
    tp_rank: int = 0
    tp_size: int = 1
    engine_agent: str = ""
    compat: KVCompat | None = None  # checked by `add_peer` (kv/nixl/compat.py)

    @property
    def pages(self) -> Pages:
        return Pages(self.base_addrs, self.page_bytes, self.num_blocks, self.device_id)


@dataclass(slots=True)
class Peer:
    info: PeerInfo
    descs: Any  # the prepared remote descriptor list (whole pages); None for another TP size


class PeerTable:
    """One rank's peers, by agent name and by engine and rank. Not thread-safe: the
    connector's lock guards it."""

    def __init__(self, slicer: PageSlicer | None) -> None:
        """`slicer`: this rank's view of the pages (kv/nixl/tp_slices.py); None for a single rank."""
        self._slicer = slicer
        self._rank, self._size = (slicer.rank, slicer.size) if slicer is not None else (0, 1)
        self.by_name: dict[str, Peer] = {}
        self.removed: set[str] = set()  # agents of dead incarnations: never loaded again
        self._ranks: dict[str, dict[int, str]] = {}  # engine agent -> rank -> agent

    def add(self, peer: Peer) -> None:
        name = peer.info.agent_name
        self.by_name[name] = peer
        self._ranks.setdefault(peer.info.engine_agent or name, {})[peer.info.tp_rank] = name

    def of_engine(self, engine_id: str) -> list[str]:
        """The agent names of every rank of `engine_id` (its id, not its agent's name)."""
        return [name for name, peer in self.by_name.items() if peer.info.engine_id == engine_id]

    def remove(self, name: str) -> Peer:
        """Forget `name` for good: it is never accepted again."""
        peer = self.by_name.pop(name)
        self.removed.add(name)
        ranks = self._ranks.get(peer.info.engine_agent or name, {})
        ranks.pop(peer.info.tp_rank, None)
        if not ranks:
            self._ranks.pop(peer.info.engine_agent or name, None)
        return peer

    def engine(self, engine_agent: str) -> list[Peer]:
        """Every rank of the engine whose rank-0 agent is `engine_agent`, in rank order."""
        ranks = self._ranks.get(engine_agent)
        if ranks is None:
            raise ValueError(f"unknown peer {engine_agent!r}")
        peers = [self.by_name[name] for _, name in sorted(ranks.items())]
        if len(peers) != peers[0].info.tp_size:
            raise ValueError(f"peer {engine_agent!r} has {len(peers)} of its {peers[0].info.tp_size} ranks registered")
        return peers

    def targets(self, peers: list[Peer], req_id: str) -> list[tuple[Peer, str]]:
        """The remote ranks this rank reads from or must notify, each with its notification.
        Equal TP sizes pair rank with rank; otherwise a remote rank read by n local ranks
        waits for n notifications, counted in the message (kv/nixl/notif_counts.py)."""
        size = peers[0].info.tp_size
        if size == self._size:
            return [(peers[self._rank], req_id)]
        assert self._slicer is not None  # add_peer refuses other TP sizes without one
        out = []
        for p, peer in enumerate(peers):
            if self._slicer.notifies(p, size):
                out.append((peer, counted(req_id, self._slicer.readers(p, size))))
        return out
