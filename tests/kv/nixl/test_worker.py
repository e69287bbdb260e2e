"""The NIXL worker connector with real agents in separate processes (Ray actors on a local
cluster) moving real bytes over UCX: pages land exactly where asked, nothing else moves,
the prefill side hears about every read or abandoned request, failures name their blocks.

No UCX variables are needed here: on one machine UCX picks tcp on `lo` plus cma. The
prefill actor makes no calls while the decode actor waits: the connector's poller thread
is what acknowledges the READs there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import ray
import torch

from kv.nixl.transfer_params import KVTransferParams
from kv.nixl.worker import FinishedTransfers, NixlWorkerConnector, PeerInfo

log = logging.getLogger(__name__)

BUFFERS = 2
NUM_BLOCKS = 16
PAGE = 4096


@ray.remote(num_cpus=0)
class Side:
    """One worker's KV buffers and connector, in its own process."""

    def __init__(
        self, engine_id: str, num_blocks: int = NUM_BLOCKS, page_bytes: int = PAGE, fail_fraction: float = 0.0
    ) -> None:
        torch.set_num_threads(1)
        self.buffers = [torch.zeros(num_blocks, page_bytes, dtype=torch.uint8) for _ in range(BUFFERS)]
        self.conn = NixlWorkerConnector(engine_id, self.buffers, page_bytes, num_blocks, fail_fraction=fail_fraction)
        self.seen = FinishedTransfers()

    def metadata(self) -> PeerInfo:
        return self.conn.metadata()

    def add_peer(self, info: PeerInfo) -> None:
        self.conn.add_peer(info)

    def fill(self, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        for buf in self.buffers:
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
        return self.pages()

    def pages(self) -> list[torch.Tensor]:
        return [buf.clone() for buf in self.buffers]

    def digest(self, block_ids: list[int]) -> str:
        return hashlib.sha256(b"".join(buf[block_ids].numpy().tobytes() for buf in self.buffers)).hexdigest()

    def start_load(self, req_id: str, params: KVTransferParams, local: list[list[int]]) -> None:
        self.conn.start_load(req_id, params, local)

    def send_notif(self, agent_name: str, req_id: str) -> None:
        self.conn.send_notif(agent_name, req_id)

    def wait(self, recv: Sequence[str] = (), send: Sequence[str] = (), timeout: float = 10.0) -> FinishedTransfers:
        """Poll until every load in `recv` ended and every id in `send` was notified; returns
        (and forgets) everything seen so far."""
        deadline = time.monotonic() + timeout
        while True:
            new = self.conn.get_finished()
            self.seen.done_sending |= new.done_sending
            self.seen.done_recving |= new.done_recving
            self.seen.failed.update(new.failed)
            ended = self.seen.done_recving | self.seen.failed.keys()
            if set(recv) <= ended and set(send) <= self.seen.done_sending:
                seen, self.seen = self.seen, FinishedTransfers()
                return seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for recv={recv} send={send}, seen {self.seen}")
            time.sleep(0.0005)

    def timed_load(self, req_id: str, params: dict, local: list[list[int]]) -> float:
        t0 = time.perf_counter()
        self.start_load(req_id, params, local)
        self.wait(recv=[req_id])
        return time.perf_counter() - t0

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def sides():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    prefill, decode, faulty = Side.remote("prefill"), Side.remote("decode"), Side.remote("faulty", fail_fraction=1.0)
    info = ray.get(prefill.metadata.remote())
    ray.get([decode.add_peer.remote(info), faulty.add_peer.remote(info)])
    yield prefill, decode, faulty, info
    ray.get([s.close.remote() for s in (prefill, decode, faulty)])
    ray.shutdown()


def params(info: PeerInfo, req_id: str, remote: Sequence[Sequence[int]], num_tokens: int = 8) -> KVTransferParams:
    return KVTransferParams(info.engine_id, info.agent_name, tuple(map(tuple, remote)), num_tokens, req_id)


def check_pages(
    after: list[torch.Tensor], before: list[torch.Tensor], src: list[torch.Tensor], moved: dict[int, int]
) -> None:
    """Local block b holds remote block moved[b] in every buffer; every other block is as before."""
    for buf_after, buf_before, buf_src in zip(after, before, src):
        for block in range(NUM_BLOCKS):
            want = buf_src[moved[block]] if block in moved else buf_before[block]
            assert torch.equal(buf_after[block], want), f"block {block}"


def test_read_moves_exactly_the_requested_pages(sides):
    prefill, decode, _, info = sides
    src, before = ray.get([prefill.fill.remote(1), decode.fill.remote(2)])
    remote = [[1, 5, 9], [3], [12, 0]]
    local = [[7, 2, 14, 15], [10], [4, 11]]  # group 0 has one spare block: it stays untouched
    ray.get(decode.start_load.remote("dec-1", params(info, "pre-1", remote), local))
    got = ray.get(decode.wait.remote(recv=["dec-1"]))
    assert "dec-1" in got.done_recving and not got.failed
    assert "pre-1" in ray.get(prefill.wait.remote(send=["pre-1"])).done_sending
    moved = {7: 1, 2: 5, 14: 9, 10: 3, 4: 12, 11: 0}
    check_pages(ray.get(decode.pages.remote()), before, src, moved)


def test_pages_land_without_the_decode_side_polling(sides):
    """The bytes arrive while the decode worker makes no call at all (no get_finished, no
    compute stream): the race of docs/design.md §1 exists on CPU too."""
    prefill, decode, _, info = sides
    src, before = ray.get([prefill.fill.remote(3), decode.fill.remote(4)])
    ray.get(decode.start_load.remote("dec-2", params(info, "pre-2", [[2, 3]]), [[8, 6]]))
    deadline = time.monotonic() + 10
    while not torch.equal(ray.get(decode.pages.remote())[1][8], src[1][2]):
        assert time.monotonic() < deadline, "the READ did not land without polling"
    check_pages(ray.get(decode.pages.remote()), before, src, {8: 2, 6: 3})
    assert "dec-2" in ray.get(decode.wait.remote(recv=["dec-2"])).done_recving
    assert "pre-2" in ray.get(prefill.wait.remote(send=["pre-2"])).done_sending


def test_concurrent_loads(sides):
    prefill, decode, _, info = sides
    src, before = ray.get([prefill.fill.remote(5), decode.fill.remote(6)])
    loads = {f"dec-c{i}": ([[i, 15 - i]], [[2 * i, 2 * i + 9]]) for i in range(4)}
    ray.get(
        [
            decode.start_load.remote(req, params(info, req.replace("dec", "pre"), remote), local)
            for req, (remote, local) in loads.items()
        ]
    )
    got = ray.get(decode.wait.remote(recv=list(loads)))
    assert got.done_recving >= set(loads) and not got.failed
    ray.get(prefill.wait.remote(send=[req.replace("dec", "pre") for req in loads]))
    moved = {mine: theirs for remote, local in loads.values() for mine, theirs in zip(local[0], remote[0])}
    check_pages(ray.get(decode.pages.remote()), before, src, moved)


@pytest.mark.parametrize(
    ("remote", "local", "read", "invalid"),
    [
        ([[1, 2, 3, 4], [5]], [[8, 9, 10, 11], [12]], {8: 1, 9: 2}, [10, 11, 12]),  # half of each group is read
        ([[6]], [[13]], {}, [13]),  # nothing read: no transfer, the notification alone
    ],
)
def test_fault_injected_load_reports_its_invalid_blocks(sides, remote, local, read, invalid):
    prefill, _, faulty, info = sides
    src, before = ray.get([prefill.fill.remote(7), faulty.fill.remote(8)])
    ray.get(faulty.start_load.remote("dec-f", params(info, "pre-f", remote), local))
    got = ray.get(faulty.wait.remote(recv=["dec-f"]))
    assert got.failed == {"dec-f": invalid} and "dec-f" not in got.done_recving
    # The valid prefix holds the prefill bytes, the rest kept its old content.
    check_pages(ray.get(faulty.pages.remote()), before, src, read)
    assert "pre-f" in ray.get(prefill.wait.remote(send=["pre-f"])).done_sending


def test_send_notif_releases_without_a_read(sides):
    prefill, decode, _, info = sides
    ray.get(decode.send_notif.remote(info.agent_name, "pre-aborted"))
    assert "pre-aborted" in ray.get(prefill.wait.remote(send=["pre-aborted"])).done_sending


def test_throughput(sides):
    """64 MiB in one load: two buffers of 128 pages of 256 KiB, a Mamba-sized page."""
    num_blocks, page = 128, 256 * 1024
    src, dst = Side.remote("big-prefill", num_blocks, page), Side.remote("big-decode", num_blocks, page)
    ray.get(src.fill.remote(9))
    info = ray.get(src.metadata.remote())
    ray.get(dst.add_peer.remote(info))
    blocks = list(range(num_blocks))
    seconds = ray.get(dst.timed_load.remote("dec-big", params(info, "pre-big", [blocks[::-1]]), [blocks]))
    assert ray.get(dst.digest.remote(blocks)) == ray.get(src.digest.remote(blocks[::-1]))
    mb = BUFFERS * num_blocks * page / 1e6
    log.info("NIXL READ of %.0f MB in %.1f ms: %.0f MB/s", mb, seconds * 1e3, mb / seconds)
    ray.get([src.close.remote(), dst.close.remote()])
    for side in (src, dst):
        ray.kill(side)


@pytest.fixture
def pair():
    """Two connectors in this process, enough to check argument validation."""
    bufs = [[torch.zeros(4, 64, dtype=torch.uint8) for _ in range(BUFFERS)] for _ in range(2)]
    a, b = (NixlWorkerConnector(name, buf, 64, 4) for name, buf in zip(("a", "b"), bufs))
    b.add_peer(a.metadata())
    yield a, b
    a.close()
    b.close()


def finish(conn: NixlWorkerConnector, req_id: str) -> FinishedTransfers:
    deadline = time.monotonic() + 10
    while True:
        got = conn.get_finished()
        if req_id in got.done_recving or req_id in got.failed:
            return got
        assert time.monotonic() < deadline, f"load {req_id} did not end"
        time.sleep(0.001)


def notified(conn: NixlWorkerConnector, req_id: str, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if req_id in conn.get_finished().done_sending:
            return True
        time.sleep(0.001)
    return False


@pytest.mark.parametrize(
    ("remote", "local"),
    [
        ([[0]], [[0], [1]]),  # group counts differ
        ([[0, 1]], [[2]]),  # more remote blocks than local ones
        ([[4]], [[0]]),  # remote id out of range
        ([[0]], [[-1]]),  # local id out of range
        ([[0], [1]], [[2], [2]]),  # a local block written twice
    ],
)
def test_a_bad_block_list_fails_that_load_alone_and_frees_the_prefill_side(pair, remote, local):
    a, b = pair
    p = KVTransferParams("a", a.agent_name, tuple(map(tuple, remote)), 4, "r")
    b.start_load("r", p, local)  # no exception: it would fail the step of every other request
    got = finish(b, "r")
    assert got.failed["r"] == [x for group in local for x in group] and not got.done_recving
    assert notified(a, "r")


def test_unknown_peers_fail_the_load_and_duplicates_raise(pair):
    a, b = pair
    b.start_load("u", KVTransferParams("x", "nobody", ((0,),), 4, "r"), [[0]])
    assert finish(b, "u").failed == {"u": [0]}
    p = KVTransferParams("a", a.agent_name, ((0,),), 4, "r")
    b.start_load("r", p, [[1]])
    with pytest.raises(ValueError, match="already in flight"):
        b.start_load("r", p, [[2]])
    assert "r" in finish(b, "r").done_recving


def test_fail_fraction_is_seeded():
    def failed_loads() -> set[str]:
        a = NixlWorkerConnector("a", [torch.zeros(4, 64, dtype=torch.uint8)], 64, 4)
        b = NixlWorkerConnector("b", [torch.zeros(4, 64, dtype=torch.uint8)], 64, 4, fail_fraction=0.5, fail_seed=7)
        b.add_peer(a.metadata())
        failed = set()
        for i in range(12):
            b.start_load(f"r{i}", KVTransferParams("a", a.agent_name, ((0, 1),), 4, f"r{i}"), [[2, 3]])
            failed |= finish(b, f"r{i}").failed.keys()
        a.close()
        b.close()
        return failed

    first = failed_loads()
    assert 0 < len(first) < 12 and failed_loads() == first


def test_constructor_and_add_peer_validate():
    with pytest.raises(ValueError, match="contiguous uint8"):
        NixlWorkerConnector("x", [torch.zeros(4, 16, dtype=torch.float32)], 64, 4)
    with pytest.raises(ValueError, match="fail_fraction"):
        NixlWorkerConnector("x", [torch.zeros(4, 64, dtype=torch.uint8)], 64, 4, fail_fraction=1.5)
    a = NixlWorkerConnector("a", [torch.zeros(4, 64, dtype=torch.uint8)], 64, 4)
    b = NixlWorkerConnector("b", [torch.zeros(4, 32, dtype=torch.uint8)], 32, 4)
    with pytest.raises(ValueError, match="pages"):
        b.add_peer(a.metadata())
    a.close()
    b.close()


def wait_gone(pid: int) -> None:
    """Until the process has exited (a zombie has closed its sockets too)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} did not exit"
        time.sleep(0.01)


def test_load_from_a_dead_peer_fails_instead_of_raising(sides):
    """A prefill worker that died: NIXL refuses the READ (or errors it); the load is reported
    failed with all its blocks, and the undeliverable notification is left to the lease."""
    _, decode, _, _ = sides
    doomed = Side.remote("doomed")
    info = ray.get(doomed.metadata.remote())
    ray.get(decode.add_peer.remote(info))
    ray.get(decode.start_load.remote("dec-ok", params(info, "pre-ok", [[1]]), [[1]]))
    assert "dec-ok" in ray.get(decode.wait.remote(recv=["dec-ok"])).done_recving
    pid = ray.get(doomed.pid.remote())
    ray.kill(doomed)
    wait_gone(pid)  # Ray reports the actor dead before its process has exited
    ray.get(decode.start_load.remote("dec-dead", params(info, "pre-dead", [[2, 3]]), [[2, 3]]))
    got = ray.get(decode.wait.remote(recv=["dec-dead"], timeout=30))
    assert got.failed == {"dec-dead": [2, 3]}
