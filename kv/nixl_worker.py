"""The worker half of the NIXL connector: a decode worker pulls a request's pages from a
prefill worker with NIXL READ, and the prefill worker learns when they have been read.

Memory. A KV cache is a list of byte buffers `[num_blocks, page_bytes]` (kv/cache_layout.py);
block b is row b of every buffer, so a block is one page per buffer. Buffers are registered
once, and one descriptor per (buffer, block) page is prepared once, locally and per peer:
index = buffer * num_blocks + block. A load is then two index lists.

Tensor parallelism. Each rank of an engine has its own agent and registers its own shard;
`PeerInfo` names the rank and its engine's rank-0 agent (the one KVTransferParams carry).
Between engines of equal TP size rank d reads whole pages from rank d. Otherwise a rank
reads its head slices from every remote rank holding some (kv/tp_slices.py), with
descriptors made per READ; a remote rank read by n ranks is notified n times, the count
in the message, and reports the request read once all n arrived.

Completion. A READ's bytes land outside the compute stream, while it runs other steps
(UCX moves them; on one host cma reads the peer's memory directly). Nothing here waits
for that stream; the scheduler keeps loaded blocks out of the zero list (docs/design.md §2).
The READ carries a notification naming the prefill request id, sent once the decode side
sees the READ done; the prefill side reports it in `done_sending` and frees the blocks.
A failed or abandoned (`send_notif`) load notifies too, so no prefill block is stranded;
one id may thus be notified twice (an errored READ whose own notification got through),
and the prefill side ignores ids it no longer holds. If the peer is gone, its lease frees
the blocks.

Progress. A READ completes only with UCX progress on BOTH sides: without the prefill
side's it stays in progress for ever although its bytes have landed, and an idle prefill
worker makes no calls. NIXL's progress thread would do it but spins without pause (1.5.1
hard-codes a zero delay): a core per agent, idle or not, halving the transfer rate on a
small machine. So it stays off and a thread of ours polls every `poll_interval_s` (about
2% of a core at 1 ms); with None, the caller's `get_finished` calls are the only progress.

Peers. A peer's `PeerInfo` carries its `KVCompat` record; `add_peer` refuses one whose cache
differs from this worker's (kv/compat.py). A dead engine's agents are removed with
`remove_peers` (its replacement has new agent names, never the old ones): loads from them
fail at once, later loads naming them fail as from an unknown peer.

UCX. On one host no variables are needed: the bundled UCX 1.23 picks tcp on `lo` plus cma
(UCX_LOG_LEVEL=info shows it). Across hosts or network namespaces set UCX_TLS=tcp and
UCX_NET_DEVICES in the worker's environment; the connector sets none.

Bounded. A load that has not ended `transfer_timeout_s` after `start_load` fails as a whole,
whichever remote rank's READ is still in flight: those handles are released (NIXL asks UCX
to cancel the READs), their prefill ranks are notified, and every block is reported in
`failed`, so the scheduler's load-failure policy decides (docs/design.md §12).

Fault injection (tests; off by default). With probability `fail_fraction` (seeded, one
draw per `start_load`) a load READs only the first half, rounded down, of each group's
blocks, notifying as usual; the rest keep their old bytes and are reported in `failed`,
as a transfer that broke off would leave them. A one-block group (a Mamba state) is not
read at all; if nothing is read, no transfer is posted and the notification goes alone.
`delay_s` holds every READ back that long before posting it, as a stalled peer or link
would; past the timeout it is a READ that never completes. With probability
`corrupt_fraction` a landed load's first block has its pages' bits flipped, which only
`--kv-verify` (`page_checksums`, kv/verify.py) detects: the block is then reported failed.
Each rank checks the spans it read from each prefill rank against that rank's checksums
of them (`read_pieces`).

Stats (`transfer_stats`, for `/metrics`): each completed load's time from posting to
completion as seen by polling (so up to `poll_interval_s` late), its pages and bytes, and
the number of loads that failed.

Threads. Without a listener thread NIXL's own thread sync is off, and the poller, the
actor thread and the compute-stream thread may all call in: one lock serialises them.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv.compat import KVCompat
from kv.nixl_shim import NIXL_ERRORS, nixl_agent, nixl_agent_config
from kv.tp_slices import PageSlicer, Piece, read_pieces
from kv.transfer_params import Checksums, KVTransferParams
from kv.transfer_stats import TransferStats
from kv.verify import corrupt, mismatched

log = logging.getLogger(__name__)

# Separates a request id from the number of notifications its blocks wait for (TP readers).
_COUNT_SEP = "\x1f"


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
    compat: KVCompat | None = None  # checked by `add_peer` (kv/compat.py)


@dataclass(slots=True)
class FinishedTransfers:
    """What finished since the last poll. A load is in exactly one of done_recving and failed."""

    done_sending: set[str] = field(default_factory=set)  # prefill side: request ids read (or abandoned)
    done_recving: set[str] = field(default_factory=set)  # decode side: loads complete
    failed: dict[str, list[int]] = field(default_factory=dict)  # decode side: local blocks left invalid


@dataclass(slots=True)
class _Peer:
    info: PeerInfo
    descs: Any  # the prepared remote descriptor list (whole pages); None for another TP size


@dataclass(slots=True)
class _Load:
    block_ids: list[int]  # every local block the load writes, in group order
    skipped: list[int]  # local blocks left unread: reported as failed
    # Every remote rank this rank reads from or must notify: (agent, notification message).
    targets: list[tuple[str, str]] = field(default_factory=list)
    kept: list[list[tuple[int, int]]] = field(default_factory=list)  # (local, remote) block pairs to READ
    # One READ per remote rank read from (agent -> handle), each carrying its notification;
    # empty when nothing is in flight.
    handles: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0  # time.monotonic() when the READs were posted
    num_descs: int = 0  # descriptors the READs move
    num_bytes: int = 0
    deadline: float = float("inf")  # time.monotonic() past which the load fails (timeout)
    post_at: float | None = None  # fault injection: the READs held back until then
    # --kv-verify: (remote rank, remote TP size) -> (kind, local block, checksum) of each block read
    expected: dict[tuple[int, int], list[tuple[str, int, int]]] = field(default_factory=dict)


def _rows(addrs: np.ndarray, length: int, device_id: int) -> np.ndarray:
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, length, device_id
    return rows


def _page_descs(base_addrs: Sequence[int], page_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    """Rows (address, length, device) of every page, buffer by buffer."""
    offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(page_bytes)
    rows = np.empty((len(base_addrs) * num_blocks, 3), dtype=np.uint64)
    for i, base in enumerate(base_addrs):
        rows[i * num_blocks : (i + 1) * num_blocks, 0] = np.uint64(base) + offsets
    rows[:, 1] = page_bytes
    rows[:, 2] = device_id
    return rows


class NixlWorkerConnector:
    def __init__(
        self,
        engine_id: str,
        buffers: list[torch.Tensor],
        page_bytes: int,
        num_blocks: int,
        *,
        backends: Sequence[str] = ("UCX",),
        agent_name: str | None = None,
        poll_interval_s: float | None = 0.001,
        fail_fraction: float = 0.0,
        fail_seed: int = 0,
        transfer_timeout_s: float = 30.0,
        delay_s: float = 0.0,
        compat: KVCompat | None = None,
        corrupt_fraction: float = 0.0,
        slicer: PageSlicer | None = None,
    ) -> None:
        """`slicer` describes this worker's tensor-parallel rank and its pages (kv/tp_slices.py);
        without one the worker is a single rank and reads single-rank peers only."""
        if not buffers:
            raise ValueError("the connector needs at least one buffer")
        device = buffers[0].device
        for i, buf in enumerate(buffers):
            if buf.dtype != torch.uint8 or buf.shape != (num_blocks, page_bytes) or not buf.is_contiguous():
                raise ValueError(
                    f"buffer {i} must be a contiguous uint8 [{num_blocks}, {page_bytes}] tensor, "
                    f"got {buf.dtype} {tuple(buf.shape)}"
                )
            if buf.device != device:
                raise ValueError(f"buffer {i} is on {buf.device}, buffer 0 on {device}")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"NIXL registers CPU or CUDA memory, not {device.type}")
        if poll_interval_s is not None and poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive or None, got {poll_interval_s}")
        if not 0.0 <= fail_fraction <= 1.0:
            raise ValueError(f"fail_fraction must be in [0, 1], got {fail_fraction}")
        if transfer_timeout_s <= 0 or delay_s < 0:
            raise ValueError(
                f"transfer_timeout_s must be positive and delay_s >= 0, got {transfer_timeout_s}, {delay_s}"
            )
        self.engine_id = engine_id
        self.page_bytes = page_bytes
        self.num_blocks = num_blocks
        # Unique per incarnation: a restarted engine's agent must never be mistaken for the old one.
        self.agent_name = agent_name or f"{engine_id}-{uuid.uuid4().hex[:12]}"
        self._buffers = list(buffers)  # registered memory must outlive the registration
        self._base_addrs = tuple(buf.data_ptr() for buf in buffers)
        self._mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self._device_id = device.index or 0  # a CPU tensor has no index; DRAM is device 0
        self._fail_fraction = fail_fraction
        self._timeout_s = transfer_timeout_s
        self._delay_s = delay_s
        self._corrupt_fraction = corrupt_fraction
        self._rng = random.Random(fail_seed)
        self._slicer = slicer
        self._tp_rank, self._tp_size = (slicer.rank, slicer.size) if slicer is not None else (0, 1)
        self._ranks: dict[str, dict[int, str]] = {}  # engine agent -> rank -> agent
        # Prefill side: counted notifications so far, and when the first came (`_on_notif`).
        self._notif_counts: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._compat = compat
        self._peers: dict[str, _Peer] = {}
        self._removed: set[str] = set()  # agents of dead incarnations: never loaded again
        self._loads: dict[str, _Load] = {}
        self._pending = FinishedTransfers()
        self.stats = TransferStats()  # under the lock; read it with `transfer_stats()`
        self._closed = False
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        if missing := set(backends) - set(self._agent.backends):
            # nixl_agent only warns about a missing plugin; without it nothing can move.
            raise RuntimeError(f"NIXL backends {sorted(missing)} are not available")
        self._reg = self._agent.register_memory(self._buffers)
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _page_descs(self._base_addrs, page_bytes, num_blocks, self._device_id), self._mem_type
        )
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if poll_interval_s is not None:
            self._poller = threading.Thread(
                target=self._poll_forever, args=(poll_interval_s,), name=f"nixl-poll-{self.agent_name}", daemon=True
            )
            self._poller.start()

    def metadata(self) -> PeerInfo:
        return PeerInfo(
            self.engine_id,
            self.agent_name,
            self._agent.get_agent_metadata(),
            self._base_addrs,
            self.page_bytes,
            self.num_blocks,
            self._mem_type,
            self._device_id,
            self._tp_rank,
            self._tp_size,
            self._engine_agent(self.agent_name, self._tp_rank),
            self._compat,
        )

    @staticmethod
    def _engine_agent(agent_name: str, rank: int) -> str:
        return agent_name.removesuffix(f"-tp{rank}") if rank else agent_name

    def add_peer(self, info: PeerInfo) -> None:
        """Load a peer's agent metadata and prepare its pages; adding a known peer again is a no-op."""
        with self._lock:
            if info.agent_name in self._peers:
                return
            if info.agent_name in self._removed:
                raise ValueError(f"peer {info.agent_name} was removed; a restarted engine has a new agent")
            if self._compat is not None:
                if info.compat is None:
                    raise ValueError(f"peer {info.agent_name} sent no KV compatibility record")
                self._compat.check(info.compat, info.agent_name)
            same_tp = info.tp_size == self._tp_size
            if (same_tp and info.page_bytes != self.page_bytes) or len(info.base_addrs) != len(self._base_addrs):
                raise ValueError(
                    f"peer {info.agent_name} has {len(info.base_addrs)} buffers of {info.page_bytes}B "
                    f"pages, this worker {len(self._base_addrs)} of {self.page_bytes}B"
                )
            name = self._agent.add_remote_agent(info.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name  # 1.5.1 returns bytes
            if name != info.agent_name:
                self._agent.remove_remote_agent(name)
                raise ValueError(f"peer metadata names agent {name!r}, PeerInfo says {info.agent_name!r}")
            if not same_tp and self._slicer is None:
                self._agent.remove_remote_agent(name)
                raise ValueError(f"peer {name} is rank {info.tp_rank} of {info.tp_size}; this worker reads whole pages")
            # A peer of another TP size is read in head slices, with descriptors made per READ.
            descs = (
                self._agent.prep_xfer_dlist(
                    name, _page_descs(info.base_addrs, info.page_bytes, info.num_blocks, info.device_id), info.mem_type
                )
                if same_tp
                else None
            )
            self._peers[name] = _Peer(info, descs)
            self._ranks.setdefault(info.engine_agent or name, {})[info.tp_rank] = name

    def remove_peers(self, engine_id: str) -> list[str]:
        """Forget every agent of `engine_id` (it died and was replaced): its loads in flight
        fail now, later loads naming it fail as unknown peers, and its names are never
        accepted again. Returns the names removed."""
        with self._lock:
            gone = [name for name, peer in self._peers.items() if peer.info.engine_id == engine_id]
            for req_id, load in list(self._loads.items()):
                if any(agent in gone for agent, _ in load.targets):
                    del self._loads[req_id]
                    for handle in load.handles.values():
                        self._release(handle)
                    self._pending.failed[req_id] = list(load.block_ids)
                    self.stats.failed += 1
            for name in gone:
                peer = self._peers.pop(name)
                if peer.descs is not None:
                    peer.descs.release()
                self._agent.remove_remote_agent(name)
                self._removed.add(name)
                ranks = self._ranks.get(peer.info.engine_agent or name, {})
                ranks.pop(peer.info.tp_rank, None)
                if not ranks:
                    self._ranks.pop(peer.info.engine_agent or name, None)
            return gone

    @property
    def peer_names(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def start_load(self, req_id: str, params: KVTransferParams, local_block_ids: Sequence[Sequence[int]]) -> None:
        """READ the request's remote blocks into `local_block_ids`, group by group, every
        buffer; poll `get_finished` for the outcome. A group whose remote list is shorter
        loads only that many blocks (the caller chose the blocks that cover the granted
        tokens). A load that cannot be posted (an unknown peer, block ids out of range) is
        reported as failed like one NIXL failed: one request's bad parameters must not fail
        the step of every other. Raises only for a load already in flight under that id."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the connector is closed")
            if req_id in self._loads:
                raise ValueError(f"a load for {req_id!r} is already in flight")
            try:
                peers = self._engine_peers(params.remote_agent_name)
                pairs = self._pair(local_block_ids, params.remote_block_ids, peers[0].info.num_blocks)
                kept = [group[: len(group) // 2] for group in pairs] if self._draw_failure() else pairs
                load = _Load(
                    block_ids=[mine for group in pairs for mine, _ in group],
                    skipped=[mine for group, k in zip(pairs, kept) for mine, _ in group[len(k) :]],
                    targets=[(p.info.agent_name, message) for p, message in self._targets(peers, params.request_id)],
                    kept=kept,
                    deadline=time.monotonic() + self._timeout_s,
                )
                if params.page_checksums is not None:
                    load.expected = self._expected(req_id, load, params.page_checksums)
            except ValueError as e:
                log.warning("KV load of %s refused: %s", req_id, e)
                self._pending.failed[req_id] = [int(b) for group in local_block_ids for b in group]
                self._notify_engine(params.remote_agent_name, params.request_id)
                return
            if self._delay_s > 0:
                load.post_at = time.monotonic() + self._delay_s
            else:
                self._post(load)
            self._loads[req_id] = load

    def _engine_peers(self, engine_agent: str) -> list[_Peer]:
        """Every rank of the engine whose rank-0 agent is `engine_agent`, in rank order."""
        ranks = self._ranks.get(engine_agent)
        if ranks is None:
            raise ValueError(f"unknown peer {engine_agent!r}")
        peers = [self._peers[name] for _, name in sorted(ranks.items())]
        if len(peers) != peers[0].info.tp_size:
            raise ValueError(f"peer {engine_agent!r} has {len(peers)} of its {peers[0].info.tp_size} ranks registered")
        return peers

    def _targets(self, peers: list[_Peer], req_id: str) -> list[tuple[_Peer, str]]:
        """The remote ranks this rank reads from or must notify, each with its notification.
        Equal TP sizes pair rank with rank; otherwise a remote rank read by n local ranks
        waits for n notifications, counted in the message (`_on_notif`)."""
        size = peers[0].info.tp_size
        if size == self._tp_size:
            return [(peers[self._tp_rank], req_id)]
        assert self._slicer is not None  # add_peer refuses other TP sizes without one
        out = []
        for p, peer in enumerate(peers):
            if self._slicer.notifies(p, size):
                n = self._slicer.readers(p, size)
                out.append((peer, req_id if n == 1 else f"{req_id}{_COUNT_SEP}{n}"))
        return out

    def _notify_engine(self, engine_agent: str, req_id: str) -> None:
        """Notify every rank of a remote engine this rank answers for (an unknown one as is)."""
        try:
            targets = self._targets(self._engine_peers(engine_agent), req_id)
        except ValueError:
            self._notify(engine_agent, req_id)
            return
        for peer, message in targets:
            self._notify(peer.info.agent_name, message)

    def get_finished(self) -> FinishedTransfers:
        """Loads that ended since the last call (decode side) and request ids whose pages a
        peer has read or abandoned (prefill side)."""
        with self._lock:
            self._poll()
            out, self._pending = self._pending, FinishedTransfers()
        return out

    def transfer_stats(self) -> TransferStats:
        with self._lock:
            return self.stats.copy()

    def held(self) -> dict[str, int]:
        """What this connector still tracks, each zero once its engine is idle (tests, leak
        checks): loads with READs in flight, ended loads not yet reported to a step, and
        requests whose reader notifications are only partly counted. Not read notifications
        not yet reported: one may come after its request stopped being held (its lease
        ended; a duplicate), and waits for the next step, which ignores it."""
        with self._lock:
            return {
                "loads": len(self._loads),
                "unreported_loads": len(self._pending.done_recving) + len(self._pending.failed),
                "partial_notifs": len(self._notif_counts),
            }

    def send_notif(self, agent_name: str, req_id: str) -> None:
        """Tell a prefill worker it may free `req_id`'s blocks without a READ (the decode side
        aborted or rejected the request)."""
        with self._lock:
            self._notify_engine(agent_name, req_id)

    def close(self) -> None:
        """Release handles and deregister memory. Call it once no load is in flight: a READ
        that NIXL cannot cancel would still write the buffers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
        if self._poller is not None:
            self._poller.join()
        with self._lock:
            for load in self._loads.values():
                for handle in load.handles.values():
                    self._release(handle)
            self._loads.clear()
            for name, peer in self._peers.items():
                if peer.descs is not None:
                    peer.descs.release()
                self._agent.remove_remote_agent(name)
            self._peers.clear()
            self._local.release()
            self._agent.deregister_memory(self._reg)

    def _poll_forever(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                self._poll()

    def _post(self, load: _Load) -> None:
        """Post one READ per remote rank read from; a rank with nothing to read, or whose READ
        NIXL refused (the load then fails), is notified at once."""
        load.post_at = None
        load.started = time.monotonic()
        for agent, message in load.targets:
            peer = self._peers[agent]
            handle = self._read(peer, load.kept, message, load) if self._reads_any(peer, load.kept) else None
            if handle is None:  # nothing in flight carries this rank's notification
                self._notify(agent, message)
            else:
                load.handles[agent] = handle

    def _expected(self, req_id: str, load: _Load, sums: Checksums) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
        """--kv-verify: per remote rank read from, the checksum its side took of the bytes this
        rank reads into each local block (`sums[remote rank][local rank][group][block]`)."""
        out: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for agent, _ in load.targets:
            info = self._peers[agent].info
            if len(sums) != info.tp_size or len(sums[info.tp_rank]) != self._tp_size:
                raise ValueError(
                    f"load {req_id}: checksums for {len(sums)} prefill x {len(sums[0]) if sums else 0} decode "
                    f"ranks, the peer has {info.tp_size} and this engine {self._tp_size}"
                )
            mine = sums[info.tp_rank][self._tp_rank]
            out[(info.tp_rank, info.tp_size)] = [
                (kind, local, mine[g][i])
                for g, (kind, group) in enumerate(zip(self._kinds(len(load.kept)), load.kept))
                for i, (local, _) in enumerate(group)
            ]
        return out

    def _kinds(self, num_groups: int) -> tuple[str, ...]:
        """Each cache group's kind; one slicer-less worker's whole pages need none."""
        return self._slicer.kinds if self._slicer is not None else ("",) * num_groups

    def _read_pieces(self, kind: str, remote_rank: int, remote_size: int) -> tuple[Piece, ...]:
        return read_pieces(self._slicer, kind, remote_rank, remote_size, self._tp_rank, self._tp_size, self.page_bytes)

    def _poll(self) -> None:
        """Progress UCX and move what ended into `_pending`; the caller holds the lock."""
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            if load.post_at is not None and now >= load.post_at and now < load.deadline:
                self._post(load)
            states = {agent: self._state(handle) for agent, handle in load.handles.items()}
            busy = load.post_at is not None or "PROC" in states.values()
            if busy and now < load.deadline:
                continue
            del self._loads[req_id]
            for handle in load.handles.values():
                # Past the deadline this cancels a READ still in flight; its notification will not go.
                self._release(handle)
            if busy:
                log.warning("KV load of %s timed out after %ss", req_id, self._timeout_s)
                unsent = [a for a, _ in load.targets] if load.post_at is not None else list(states)
                self._fail_reads(load, [a for a in unsent if states.get(a) != "DONE"])
            elif errs := [a for a, state in states.items() if state == "ERR"]:
                log.warning("KV load of %s from %s failed", req_id, errs)
                self._fail_reads(load, errs)
            else:
                self._maybe_corrupt(load)
                if load.expected:
                    self._verify(req_id, load)
            if load.skipped:
                self._pending.failed[req_id] = load.skipped
                self.stats.failed += 1
            else:
                self._pending.done_recving.add(req_id)
                self._count(load)
        try:
            notifs = self._agent.get_new_notifs()
        except NIXL_ERRORS as e:
            log.warning("NIXL notifications unavailable: %r", e)
            return
        for agent, msgs in notifs.items():
            for msg in msgs:
                try:
                    self._on_notif(msg.decode())
                except UnicodeDecodeError:
                    log.warning("ignoring a notification from %s that is no request id: %r", agent, msg[:64])
        self._forget_stale_counts(now)

    def _on_notif(self, text: str) -> None:
        """A request id, or `id<SEP>n` when n readers (other TP ranks) each send one: the
        blocks are read once all n arrived."""
        req_id, sep, count = text.rpartition(_COUNT_SEP)
        if not sep or not count.isdigit():
            self._pending.done_sending.add(text)
            return
        seen, first = self._notif_counts.pop(req_id, (0, time.monotonic()))
        if seen + 1 >= int(count):
            self._pending.done_sending.add(req_id)
        else:
            self._notif_counts[req_id] = (seen + 1, first)

    def _forget_stale_counts(self, now: float) -> None:
        """Drop counts whose other notifications are overdue: a decode rank died mid-load. Its
        readers all start at one engine step and each ends within the transfer timeout, so
        past twice that none is coming; the request's blocks go at the end of its lease."""
        for req_id, (seen, first) in list(self._notif_counts.items()):
            if now - first > 2 * self._timeout_s:
                log.warning("request %s: %d of its readers notified; the rest are overdue", req_id, seen)
                del self._notif_counts[req_id]

    def _fail_reads(self, load: _Load, agents: list[str]) -> None:
        """Every block of `load` is invalid; these remote ranks' notifications did not go."""
        load.skipped = list(load.block_ids)
        messages = dict(load.targets)
        for agent in agents:
            self._notify(agent, messages[agent])

    def _maybe_corrupt(self, load: _Load) -> None:
        """Test fault: the first block READ goes bad after hand-over (on the way, or in memory)."""
        skipped = set(load.skipped)
        read = [b for b in load.block_ids if b not in skipped]
        if read and self._corrupt_fraction > 0.0 and self._rng.random() < self._corrupt_fraction:
            corrupt(self._buffers, read[0])

    def _verify(self, req_id: str, load: _Load) -> None:
        """--kv-verify: a block whose bytes read from some remote rank do not match that rank's
        checksum of them is invalid."""
        skipped, bad = set(load.skipped), set()
        for (rank, size), entries in load.expected.items():
            for kind in dict.fromkeys(k for k, _, _ in entries):
                blocks = [(b, s) for k, b, s in entries if k == kind and b not in skipped]
                spans = [(p.local, p.length) for p in self._read_pieces(kind, rank, size)]
                bad.update(mismatched(self._buffers, [b for b, _ in blocks], [s for _, s in blocks], spans))
        if bad:
            log.warning("KV load of %s: blocks %s fail their checksums", req_id, sorted(bad))
            load.skipped = sorted(skipped | bad)
            self.stats.corrupt += 1

    def _count(self, load: _Load) -> None:
        if load.handles:  # a load of nothing (no blocks granted) moved nothing
            self.stats.seconds.observe(time.monotonic() - load.started)
            self.stats.bytes += load.num_bytes
            self.stats.descriptors += load.num_descs

    def _pair(
        self, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], remote_num_blocks: int
    ) -> list[list[tuple[int, int]]]:
        """(local, remote) block pairs per group, validated."""
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local block lists for {len(remote)} remote cache groups")
        pairs: list[list[tuple[int, int]]] = []
        seen: set[int] = set()
        for g, (mine, theirs) in enumerate(zip(local, remote)):
            if len(theirs) > len(mine):
                raise ValueError(f"group {g}: {len(theirs)} remote blocks do not fit in {len(mine)} local ones")
            group = [(int(a), int(b)) for a, b in zip(mine, theirs)]
            for a, b in group:
                if not 0 <= a < self.num_blocks or not 0 <= b < remote_num_blocks:
                    raise ValueError(
                        f"group {g}: block pair ({a}, {b}) out of range "
                        f"({self.num_blocks} local, {remote_num_blocks} remote blocks)"
                    )
                if a in seen:
                    raise ValueError(f"local block {a} is written twice by one load")
                seen.add(a)
            pairs.append(group)
        return pairs

    def _draw_failure(self) -> bool:
        return self._fail_fraction > 0.0 and self._rng.random() < self._fail_fraction

    def _reads_any(self, peer: _Peer, pairs: list[list[tuple[int, int]]]) -> bool:
        if peer.descs is not None:
            return any(pairs)
        assert self._slicer is not None
        info = peer.info
        return any(
            group and self._slicer.pieces(kind, info.tp_rank, info.tp_size)
            for kind, group in zip(self._slicer.kinds, pairs)
        )

    def _read(self, peer: _Peer, pairs: list[list[tuple[int, int]]], notif: str, load: _Load) -> Any:
        """Post the READ of these block pairs from one remote rank and count it in `load`;
        None if NIXL refused it (the whole load then fails). Whole pages from a rank of the
        same TP size, head slices from another (kv/tp_slices.py)."""
        try:
            if peer.descs is not None:
                indices = self._page_indices(peer, pairs)
                handle = self._agent.make_prepped_xfer("READ", self._local, *indices, notif_msg=notif.encode())
                num_descs, num_bytes = len(indices[0]), len(indices[0]) * self.page_bytes
            else:
                local, remote = self._slice_descs(peer, pairs)
                num_descs, num_bytes = len(local), int(local[:, 1].sum())
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, self._mem_type),
                    self._agent.get_xfer_descs(remote, peer.info.mem_type),
                    peer.info.agent_name,
                    notif.encode(),
                )
        except NIXL_ERRORS as e:
            log.warning("NIXL refused a READ from %s: %r", peer.info.agent_name, e)
            return None
        try:
            if self._agent.transfer(handle) != "ERR":
                load.num_descs += num_descs
                load.num_bytes += num_bytes
                return handle
            log.warning("NIXL could not post a READ from %s", peer.info.agent_name)
        except NIXL_ERRORS as e:
            log.warning("NIXL could not post a READ from %s: %r", peer.info.agent_name, e)
        self._release(handle)
        load.skipped = list(load.block_ids)
        return None

    def _page_indices(self, peer: _Peer, pairs: list[list[tuple[int, int]]]) -> tuple[np.ndarray, Any, np.ndarray]:
        """Indices into the prepared page lists of every buffer's pages of these blocks."""
        local = np.asarray([a for group in pairs for a, _ in group], dtype=np.int64)
        remote = np.asarray([b for group in pairs for _, b in group], dtype=np.int64)
        buffers = np.arange(len(self._base_addrs), dtype=np.int64)[:, None]
        local_idx = (buffers * self.num_blocks + local).ravel().astype(np.int32)
        remote_idx = (buffers * peer.info.num_blocks + remote).ravel().astype(np.int32)
        return local_idx, peer.descs, remote_idx

    def _slice_descs(self, peer: _Peer, pairs: list[list[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
        """(address, length, device) rows, local and remote, of this rank's head slices of
        the remote rank's pages: per group, buffer, block pair and piece."""
        assert self._slicer is not None
        info = peer.info
        local_rows: list[np.ndarray] = []
        remote_rows: list[np.ndarray] = []
        for kind, group in zip(self._slicer.kinds, pairs):
            pieces = self._slicer.pieces(kind, info.tp_rank, info.tp_size)
            if not group or not pieces:
                continue
            mine = np.asarray([a for a, _ in group], dtype=np.uint64)
            theirs = np.asarray([b for _, b in group], dtype=np.uint64)
            for base, remote_base in zip(self._base_addrs, info.base_addrs):
                for piece in pieces:
                    local_rows.append(
                        _rows(
                            base + mine * np.uint64(self.page_bytes) + np.uint64(piece.local),
                            piece.length,
                            self._device_id,
                        )
                    )
                    remote_rows.append(
                        _rows(
                            remote_base + theirs * np.uint64(info.page_bytes) + np.uint64(piece.remote),
                            piece.length,
                            info.device_id,
                        )
                    )
        return np.concatenate(local_rows), np.concatenate(remote_rows)

    def _state(self, handle: Any) -> str:
        try:
            return self._agent.check_xfer_state(handle)
        except NIXL_ERRORS as e:
            log.warning("NIXL transfer state unavailable: %r", e)
            return "ERR"

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except NIXL_ERRORS as e:
            log.warning("NIXL could not release a transfer handle: %r", e)

    def _notify(self, agent_name: str, req_id: str) -> None:
        try:
            self._agent.send_notif(agent_name, req_id.encode())
        except NIXL_ERRORS as e:
            # The peer is gone or unreachable: its lease frees the blocks.
            log.warning("could not notify %s about %s: %r", agent_name, req_id, e)
