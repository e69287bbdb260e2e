"""The worker half of the NIXL connector: a decode worker pulls a request's pages from a
prefill worker with NIXL READ, and the prefill worker learns when they have been read.

Memory. Buffers are registered once and their pages described once, locally and per peer;
a load is then two index lists, or per-READ descriptors of head slices (kv/nixl/read_descs.py).

Tensor parallelism. Each rank of an engine has its own agent and registers its own shard;
between engines of equal TP size rank d reads whole pages from rank d, otherwise a rank
reads its head slices from every remote rank holding some (kv/nixl/peers.py), and each
remote rank counts its readers' notifications (kv/nixl/notif_counts.py).

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
differs from this worker's (kv/nixl/compat.py). A dead engine's agents are removed with
`remove_peers` (its replacement has new agent names, never the old ones): loads from them
fail at once, later loads naming them fail as from an unknown peer (kv/nixl/peers.py).

UCX. On one host no variables are needed: the bundled UCX 1.23 picks tcp on `lo` plus cma
(UCX_LOG_LEVEL=info shows it). Across hosts or network namespaces set UCX_TLS=tcp and
UCX_NET_DEVICES in the worker's environment; the connector sets none.

Bounded. A load that has not ended `transfer_timeout_s` after `start_load` fails as a whole,
whichever remote rank's READ is still in flight: those handles are released (NIXL asks UCX
to cancel the READs), their prefill ranks are notified, and every block is reported in
`failed`, so the scheduler's load-failure policy decides (docs/design.md §12).

Fault injection (tests; off by default): `fail_fraction`, `delay_s` and `corrupt_fraction`
(kv/nixl/load_faults.py). A load's blocks left unread or failing their `--kv-verify` checksums
are reported in `failed` (kv/nixl/load.py).

Stats (`transfer_stats`, for `/metrics`): each completed load's time from posting to
completion as seen by polling (so up to `poll_interval_s` late), its pages and bytes, and
the number of loads that failed.

Threads. Without a listener thread NIXL's own thread sync is off, and the poller, the
actor thread and the compute-stream thread may all call in: one lock serialises them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kv.cache_buffers import buffer_pages
from kv.nixl.compat import KVCompat
from kv.nixl.load import Load, pair_blocks
from kv.nixl.load_faults import LoadFaults
from kv.nixl.load_verify import LoadVerifier
from kv.nixl.notif_counts import NotifCounts
from kv.nixl.peers import Peer, PeerInfo, PeerTable
from kv.nixl.read_descs import page_indices, reads_any, slice_descs
from kv.nixl.shim import NIXL_ERRORS, nixl_agent, nixl_agent_config
from kv.nixl.tp_slices import PageSlicer, Piece
from kv.nixl.transfer_params import KVTransferParams
from kv.nixl.transfer_stats import TransferStats

__all__ = ["FinishedTransfers", "NixlWorkerConnector", "PeerInfo"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FinishedTransfers:
    """What finished since the last poll. A load is in exactly one of done_recving and failed."""

    done_sending: set[str] = field(default_factory=set)  # prefill side: request ids read (or abandoned)
    done_recving: set[str] = field(default_factory=set)  # decode side: loads complete
    failed: dict[str, list[int]] = field(default_factory=dict)  # decode side: local blocks left invalid


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
        """`slicer` describes this worker's tensor-parallel rank and its pages (kv/nixl/tp_slices.py);
        without one the worker is a single rank and reads single-rank peers only."""
        pages = buffer_pages(buffers, page_bytes, num_blocks)
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
        self._pages = pages
        self._mem_type = "VRAM" if buffers[0].device.type == "cuda" else "DRAM"
        self._timeout_s = transfer_timeout_s
        self._faults = LoadFaults(fail_fraction, corrupt_fraction, delay_s, fail_seed)
        self._slicer = slicer
        self._tp_rank, self._tp_size = (slicer.rank, slicer.size) if slicer is not None else (0, 1)
        self._verifier = LoadVerifier(self._buffers, page_bytes, slicer)
        self._notif_counts = NotifCounts(transfer_timeout_s)  # prefill side
        self._lock = threading.Lock()
        self._compat = compat
        self._peers = PeerTable(slicer)
        self._loads: dict[str, Load] = {}
        self._pending = FinishedTransfers()
        self.stats = TransferStats()  # under the lock; read it with `transfer_stats()`
        self._closed = False
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        if missing := set(backends) - set(self._agent.backends):
            # nixl_agent only warns about a missing plugin; without it nothing can move.
            raise RuntimeError(f"NIXL backends {sorted(missing)} are not available")
        self._reg = self._agent.register_memory(self._buffers)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._pages.descs(), self._mem_type)
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
            self._pages.base_addrs,
            self.page_bytes,
            self.num_blocks,
            self._mem_type,
            self._pages.device_id,
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
            if info.agent_name in self._peers.by_name:
                return
            if info.agent_name in self._peers.removed:
                raise ValueError(f"peer {info.agent_name} was removed; a restarted engine has a new agent")
            if self._compat is not None:
                if info.compat is None:
                    raise ValueError(f"peer {info.agent_name} sent no KV compatibility record")
                self._compat.check(info.compat, info.agent_name)
            same_tp = info.tp_size == self._tp_size
            if (same_tp and info.page_bytes != self.page_bytes) or len(info.base_addrs) != len(self._pages.base_addrs):
                raise ValueError(
                    f"peer {info.agent_name} has {len(info.base_addrs)} buffers of {info.page_bytes}B "
                    f"pages, this worker {len(self._pages.base_addrs)} of {self.page_bytes}B"
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
            descs = self._agent.prep_xfer_dlist(name, info.pages.descs(), info.mem_type) if same_tp else None
            self._peers.add(Peer(info, descs))

    def remove_peers(self, engine_id: str) -> list[str]:
        """Forget every agent of `engine_id` (it died and was replaced): its loads in flight
        fail now, later loads naming it fail as unknown peers, and its names are never
        accepted again. Returns the names removed."""
        with self._lock:
            gone = self._peers.of_engine(engine_id)
            for req_id, load in list(self._loads.items()):
                if any(agent in gone for agent, _ in load.targets):
                    del self._loads[req_id]
                    for handle in load.handles.values():
                        self._release(handle)
                    self._pending.failed[req_id] = list(load.block_ids)
                    self.stats.failed += 1
            for name in gone:
                peer = self._peers.remove(name)
                if peer.descs is not None:
                    peer.descs.release()
                self._agent.remove_remote_agent(name)
            return gone

    @property
    def peer_names(self) -> list[str]:
        with self._lock:
            return sorted(self._peers.by_name)

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
                peers = self._peers.engine(params.remote_agent_name)
                pairs = pair_blocks(local_block_ids, params.remote_block_ids, self.num_blocks, peers[0].info.num_blocks)
                kept = self._faults.kept(pairs)
                load = Load(
                    block_ids=[mine for group in pairs for mine, _ in group],
                    skipped=[mine for group, k in zip(pairs, kept) for mine, _ in group[len(k) :]],
                    targets=[
                        (p.info.agent_name, message) for p, message in self._peers.targets(peers, params.request_id)
                    ],
                    kept=kept,
                    deadline=time.monotonic() + self._timeout_s,
                )
                if params.page_checksums is not None:
                    remotes = [self._peers.by_name[agent].info for agent, _ in load.targets]
                    load.expected = self._verifier.expected(req_id, load, remotes, params.page_checksums)
            except ValueError as e:
                log.warning("KV load of %s refused: %s", req_id, e)
                self._pending.failed[req_id] = [int(b) for group in local_block_ids for b in group]
                self._notify_engine(params.remote_agent_name, params.request_id)
                return
            if self._faults.delay_s > 0:
                load.post_at = time.monotonic() + self._faults.delay_s
            else:
                self._post(load)
            self._loads[req_id] = load

    def _notify_engine(self, engine_agent: str, req_id: str) -> None:
        """Notify every rank of a remote engine this rank answers for (an unknown one as is)."""
        try:
            targets = self._peers.targets(self._peers.engine(engine_agent), req_id)
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
            for name, peer in self._peers.by_name.items():
                if peer.descs is not None:
                    peer.descs.release()
                self._agent.remove_remote_agent(name)
            self._peers.by_name.clear()
            self._local.release()
            self._agent.deregister_memory(self._reg)

    def _poll_forever(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                self._poll()

    def _post(self, load: Load) -> None:
        """Post one READ per remote rank read from; a rank with nothing to read, or whose READ
        NIXL refused (the load then fails), is notified at once."""
        load.post_at = None
        load.started = time.monotonic()
        for agent, message in load.targets:
            peer = self._peers.by_name[agent]
            pieces = None if peer.descs is not None else self._pieces(peer.info)
            handle = self._read(peer, pieces, message, load) if reads_any(load.kept, pieces) else None
            if handle is None:  # nothing in flight carries this rank's notification
                self._notify(agent, message)
            else:
                load.handles[agent] = handle

    def _pieces(self, info: PeerInfo) -> list[tuple[Piece, ...]]:
        """This rank's head slices of each group's pages of a remote rank of another TP size."""
        assert self._slicer is not None  # add_peer refuses other TP sizes without one
        return [self._slicer.pieces(kind, info.tp_rank, info.tp_size) for kind in self._slicer.kinds]

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
                self._faults.maybe_corrupt(self._buffers, load.read_blocks())
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
                    text = msg.decode()
                except UnicodeDecodeError:
                    log.warning("ignoring a notification from %s that is no request id: %r", agent, msg[:64])
                    continue
                if (read := self._notif_counts.on_notif(text)) is not None:
                    self._pending.done_sending.add(read)
        self._notif_counts.forget_stale(now)

    def _fail_reads(self, load: Load, agents: list[str]) -> None:
        """Every block of `load` is invalid; these remote ranks' notifications did not go."""
        load.fail()
        messages = dict(load.targets)
        for agent in agents:
            self._notify(agent, messages[agent])

    def _verify(self, req_id: str, load: Load) -> None:
        """--kv-verify: a block whose bytes do not match their checksum is invalid."""
        if bad := self._verifier.mismatched(load):
            log.warning("KV load of %s: blocks %s fail their checksums", req_id, sorted(bad))
            load.skipped = sorted(set(load.skipped) | bad)
            self.stats.corrupt += 1

    def _count(self, load: Load) -> None:
        if load.handles:  # a load of nothing (no blocks granted) moved nothing
            self.stats.seconds.observe(time.monotonic() - load.started)
            self.stats.bytes += load.num_bytes
            self.stats.descriptors += load.num_descs

    def _read(self, peer: Peer, pieces: list[tuple[Piece, ...]] | None, notif: str, load: Load) -> Any:
        """Post the READ of `load`'s block pairs from one remote rank and count it in `load`;
        None if NIXL refused it (the whole load then fails). Whole pages from a rank of the
        same TP size, head slices (`pieces`, per group) from another (kv/nixl/read_descs.py)."""
        try:
            if pieces is None:
                local_idx, remote_idx = page_indices(self._pages, peer.info.pages, load.kept)
                handle = self._agent.make_prepped_xfer(
                    "READ", self._local, local_idx, peer.descs, remote_idx, notif_msg=notif.encode()
                )
                num_descs, num_bytes = len(local_idx), len(local_idx) * self.page_bytes
            else:
                local, remote = slice_descs(self._pages, peer.info.pages, pieces, load.kept)
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
            load.fail()  # with no READ in flight the load would otherwise end as landed
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
        load.fail()
        return None

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
