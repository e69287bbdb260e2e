"""Moving one request's KV from a prefill worker to a decode worker, four ways, in one run:

- `nixl`: the project's path, `kv/nixl/worker.py` in two Ray actors: the decode actor
  posts one READ of the request's pages (prepared descriptors, no staging copy) and polls
  until NIXL reports it done; the prefill actor only runs the connector's poller thread.
- `memcpy`: the same bytes copied by one thread in one process: the limit.
- `cma`: the decode actor reads the prefill actor's pages with one `process_vm_readv` call
  (the kernel's cross-memory attach, which UCX's `cma` transport uses on one host): the
  limit of any copy between two processes on this machine.
- `ray`: the decode actor asks the prefill actor for the pages; they go through the Ray
  object store (prefill copies into it, decode maps them and copies them into its cache).
- `gloo`: `torch.distributed` send/recv between the two actors (TCP on loopback), straight
  into the decode cache's pages, timed on the receiver from a barrier.

Every endpoint's host buffers are allocated as a raypd worker's KV cache is (on transparent
huge pages, kv/nixl/host_pages.py), so the limit and the paths copy between the same kind of pages.

A block is `--buffers` pages, one per cache buffer (the layers of kv/cache_layout.py), of
`block_mib / buffers` MiB each. Sizes: every `--blocks` count for every `--block-mib`,
capped at `--max-mib`. Each is moved `--reps` times after a warm-up; the median counts.
The bytes that land are checked against the source after every move.

    python -m bench.kv_transfer [--blocks 1,16,256] [--block-mib 1,4] [--reps 5] [--json-out FILE]

The last line is JSON: the geometric means, over the sizes of at least 16 MB, of NIXL's
bandwidth over each other path's (`nixl_over_memcpy`, `nixl_over_cma`, `nixl_over_ray`,
`nixl_over_gloo`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import ray
import torch
import torch.distributed as dist

from actors.ports import free_port
from bench.cma import read_spans
from kv.cache_buffers import page_buffer
from kv.nixl.transfer_params import KVTransferParams
from kv.nixl.worker import NixlWorkerConnector, PeerInfo

PATHS = ("nixl", "memcpy", "cma", "ray", "gloo")
CUDA_PATHS = ("nixl", "memcpy")  # VRAM: NIXL registers it; the other paths are host-memory ones
_LOAD_TIMEOUT_S = 60.0


def timed_load(conn: NixlWorkerConnector, req_id: str, params: KVTransferParams, blocks: int) -> float:
    """Seconds from posting a load of blocks [0, `blocks`) until the connector reports it landed."""
    t0 = time.perf_counter()
    conn.start_load(req_id, params, [list(range(blocks))])
    deadline = t0 + _LOAD_TIMEOUT_S
    while True:
        got = conn.get_finished()
        if req_id in got.failed:
            raise RuntimeError(f"NIXL load {req_id} failed: {got.failed[req_id]}")
        if req_id in got.done_recving:
            return time.perf_counter() - t0
        if time.perf_counter() > deadline:
            raise TimeoutError(f"NIXL load {req_id} did not finish in {_LOAD_TIMEOUT_S} s")
        time.sleep(0)


@dataclass(frozen=True, slots=True)
class Row:
    path: str
    blocks: int
    block_mib: float
    mbytes: float  # decimal MB moved
    latency_ms: float  # median over the reps
    gb_per_s: float


def _pages(num_blocks: int, page_bytes: int, device: str, gen: torch.Generator | None) -> torch.Tensor:
    """A cache buffer allocated as a worker's is, random bytes from `gen` or zeros."""
    buf = page_buffer(num_blocks, page_bytes, device)
    if gen is not None:  # drawn on the host: `gen` is a CPU generator
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    return buf


@ray.remote(num_cpus=0)
class Endpoint:
    """One worker's cache buffers, its NIXL connector and a gloo rank, in its own process."""

    def __init__(self, name: str, buffers: int, num_blocks: int, page_bytes: int, seed: int, device: str) -> None:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(seed)
        self.bufs = [_pages(num_blocks, page_bytes, device, g) for _ in range(buffers)]
        self.conn = NixlWorkerConnector(name, self.bufs, page_bytes, num_blocks)
        self.peer: ray.actor.ActorHandle | None = None
        self.loads = 0

    def metadata(self) -> PeerInfo:
        return self.conn.metadata()

    def connect(self, info: PeerInfo, peer: ray.actor.ActorHandle) -> None:
        self.conn.add_peer(info)
        self.peer = peer

    def digest(self, blocks: int) -> list[int]:
        """A cheap fingerprint of the first `blocks` pages of every buffer."""
        return [int(buf[:blocks].view(torch.int64).sum()) for buf in self.bufs]

    def scramble(self) -> None:
        """Overwrite the cache so a check after a transfer sees only what it moved."""
        for buf in self.bufs:
            buf.fill_(0xA5)

    def nixl_load(self, info: PeerInfo, blocks: int) -> float:
        self.loads += 1
        req = f"load-{self.loads}"
        ids = tuple(range(blocks))
        params = KVTransferParams(info.engine_id, info.agent_name, (ids,), blocks, req)
        return timed_load(self.conn, req, params, blocks)

    def pid(self) -> int:
        return os.getpid()

    def spans(self, blocks: int) -> list[tuple[int, int]]:
        """(address, bytes) of the first `blocks` pages of every buffer."""
        return [(buf.data_ptr(), blocks * buf.shape[1]) for buf in self.bufs]

    def cma_load(self, pid: int, remote: list[tuple[int, int]], blocks: int) -> float:
        local = self.spans(blocks)
        t0 = time.perf_counter()
        read_spans(pid, local, remote)
        return time.perf_counter() - t0

    def pages(self, blocks: int) -> list[np.ndarray]:
        # numpy arrays travel through the object store without pickling their bytes.
        return [buf[:blocks].numpy() for buf in self.bufs]

    def ray_load(self, blocks: int) -> float:
        assert self.peer is not None
        t0 = time.perf_counter()
        pages = ray.get(self.peer.pages.remote(blocks))
        for buf, page in zip(self.bufs, pages, strict=False):
            buf[:blocks].copy_(torch.from_numpy(page))
        return time.perf_counter() - t0

    def gloo_init(self, rank: int, port: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def gloo_send(self, blocks: int) -> None:
        dist.barrier()
        for buf in self.bufs:
            dist.send(buf[:blocks], dst=1)

    def gloo_recv(self, blocks: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for buf in self.bufs:
            dist.recv(buf[:blocks], src=0)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@ray.remote(num_cpus=0)
class Memcpy:
    """The limit: the same pages copied by one thread in one process."""

    def __init__(self, num_blocks: int, page_bytes: int, buffers: int, device: str) -> None:
        torch.set_num_threads(1)
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(0)
        self.src = [_pages(num_blocks, page_bytes, device, g) for _ in range(buffers)]
        self.dst = [_pages(num_blocks, page_bytes, device, None) for _ in range(buffers)]

    def load(self, blocks: int) -> float:
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self.src, strict=False):
            d[:blocks].copy_(s[:blocks])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def check(self, blocks: int) -> bool:
        return all(torch.equal(d[:blocks], s[:blocks]) for d, s in zip(self.dst, self.src, strict=False))


def _one_layout(block_mib: float, counts: list[int], buffers: int, reps: int, device: str) -> list[Row]:
    """Every size of one block layout. The paths take turns within each repetition, so a
    burst of load from elsewhere on the machine does not land on one path only."""
    page_bytes = int(block_mib * 2**20) // buffers
    num_blocks = max(counts)
    paths = CUDA_PATHS if device == "cuda" else PATHS
    # Each actor asks for half a GPU so Ray lets both see the device.
    actor = Endpoint.options(num_gpus=0.5) if device == "cuda" else Endpoint
    prefill = actor.remote("bench-prefill", buffers, num_blocks, page_bytes, seed=1, device=device)
    decode = actor.remote("bench-decode", buffers, num_blocks, page_bytes, seed=2, device=device)
    info = ray.get(prefill.metadata.remote())
    ray.get(decode.connect.remote(info, prefill))
    prefill_pid = ray.get(prefill.pid.remote())
    port = free_port()
    ray.get([prefill.gloo_init.remote(0, port), decode.gloo_init.remote(1, port)])
    memcpy = (Memcpy.options(num_gpus=0.5) if device == "cuda" else Memcpy).remote(
        num_blocks, page_bytes, buffers, device
    )
    rows = []
    try:
        for blocks in counts:
            want = ray.get(prefill.digest.remote(blocks))
            spans = ray.get(prefill.spans.remote(blocks))
            times: dict[str, list[float]] = {path: [] for path in paths}
            for rep in range(reps + 1):  # the first repetition is a warm-up
                for path in paths:
                    ray.get(decode.scramble.remote())
                    if path == "nixl":
                        sec = ray.get(decode.nixl_load.remote(info, blocks))
                    elif path == "cma":
                        sec = ray.get(decode.cma_load.remote(prefill_pid, spans, blocks))
                    elif path == "ray":
                        sec = ray.get(decode.ray_load.remote(blocks))
                    elif path == "gloo":
                        sent = prefill.gloo_send.remote(blocks)
                        sec = ray.get(decode.gloo_recv.remote(blocks))
                        ray.get(sent)
                    else:
                        sec = ray.get(memcpy.load.remote(blocks))
                    landed = ray.get(memcpy.check.remote(blocks) if path == "memcpy" else decode.digest.remote(blocks))
                    landed = landed if path == "memcpy" else landed == want
                    if not landed:
                        raise RuntimeError(f"{path}: the destination does not hold the source pages")
                    if rep:
                        times[path].append(sec)
            mbytes = blocks * page_bytes * buffers / 1e6
            for path in paths:
                sec = statistics.median(times[path])
                rows.append(
                    Row(path, blocks, block_mib, round(mbytes, 2), round(sec * 1e3, 3), round(mbytes / 1e3 / sec, 3))
                )
                print(
                    f"{block_mib:4g} MiB/block {blocks:4d} blocks {mbytes:8.1f} MB  {path:6s} "
                    f"{sec * 1e3:9.2f} ms  {mbytes / 1e3 / sec:7.2f} GB/s",
                    flush=True,
                )
    finally:
        ray.get([prefill.close.remote(), decode.close.remote()])
        for actor in (prefill, decode, memcpy):
            ray.kill(actor)
    return rows


def headline(rows: list[Row], min_mbytes: float = 16.0) -> dict[str, float]:
    """NIXL's bandwidth over each other path's: geometric mean over the sizes >= min_mbytes."""
    by_size: dict[tuple[float, int], dict[str, float]] = {}
    for r in rows:
        if r.mbytes >= min_mbytes:
            by_size.setdefault((r.block_mib, r.blocks), {})[r.path] = r.gb_per_s
    out = {}
    for other in ("memcpy", "cma", "ray", "gloo"):
        ratios = [s["nixl"] / s[other] for s in by_size.values() if other in s]
        out[f"nixl_over_{other}"] = round(math.exp(statistics.fmean(map(math.log, ratios))), 3) if ratios else math.nan
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=_ints, default=[1, 16, 256], help="blocks per request (comma list)")
    ap.add_argument("--block-mib", type=_floats, default=[1.0, 4.0], help="MiB per block (comma list)")
    ap.add_argument("--buffers", type=int, default=4, help="cache buffers a block spans")
    ap.add_argument("--max-mib", type=float, default=1024.0, help="skip sizes above this many MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the caches live; cuda moves VRAM by NIXL and compares with a device copy only",
    )
    ap.add_argument("--json-out", type=Path, help="also write every row here")
    args = ap.parse_args()
    if args.reps < 1 or args.buffers < 1 or not args.blocks or min(args.blocks) < 1 or min(args.block_mib) <= 0:
        ap.error("--reps, --buffers, --blocks and --block-mib must be positive")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        for block_mib in args.block_mib:
            counts = [n for n in args.blocks if n * block_mib <= args.max_mib]
            if counts:
                rows += _one_layout(block_mib, counts, args.buffers, args.reps, args.device)
    finally:
        ray.shutdown()
    result = headline(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": [asdict(r) for r in rows], **result}, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
