"""What `--kv-verify` costs: one request's KV READ over NIXL with and without checksums, in
one run, plus the prefill side's checksum at hand-over.

Two `NixlWorkerConnector`s in this process (real agents, UCX over loopback and cma, as on
one host) move a request of `blocks` blocks of `block_mib` MiB, each spread over
`--buffers` pages. `read` posts the READ and polls until it is done; `verified` is the same
READ with `page_checksums`, so the decode side checksums the landed pages before reporting
the load done (kv/nixl/verify.py; CRC-32 on CPU memory). `handover` is the prefill worker's
checksum of the same blocks after its forward. Each is run `--reps` times after a warm-up;
the median counts.

    python -m bench.kv_verify [--blocks 16,256] [--block-mib 0.25,1] [--reps 5] [--json-out FILE]

The last line is JSON: the geometric means, over all sizes, of `verified_over_read` (the
decode side's load time with verification over without) and `handover_over_read` (the
prefill side's extra work over the READ), and the checksum rate in GB/s.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.kv_transfer import timed_load
from kv.nixl.transfer_params import KVTransferParams
from kv.nixl.verify import checksum_blocks
from kv.nixl.worker import NixlWorkerConnector


@dataclass(frozen=True, slots=True)
class Row:
    blocks: int
    block_mib: float
    mbytes: float
    read_ms: float
    verified_ms: float
    handover_ms: float
    checksum_gb_per_s: float


def _one(blocks: int, block_mib: float, buffers: int, reps: int) -> Row:
    page = int(block_mib * (1 << 20)) // buffers
    src = [torch.randint(0, 256, (blocks, page), dtype=torch.uint8) for _ in range(buffers)]
    dst = [torch.zeros(blocks, page, dtype=torch.uint8) for _ in range(buffers)]
    pre = NixlWorkerConnector("bench-pre", src, page, blocks)
    dec = NixlWorkerConnector("bench-dec", dst, page, blocks, poll_interval_s=None)
    try:
        dec.add_peer(pre.metadata())
        ids = list(range(blocks))
        sums = (((tuple(checksum_blocks(src, ids)),),),)  # one prefill rank, one decode rank, one group
        plain = KVTransferParams("bench-pre", pre.agent_name, (tuple(ids),), blocks, "r")
        checked = KVTransferParams("bench-pre", pre.agent_name, (tuple(ids),), blocks, "r", page_checksums=sums)
        times: dict[str, list[float]] = {"read": [], "verified": [], "handover": []}
        for rep in range(reps + 1):  # the first is a warm-up
            read = timed_load(dec, f"plain-{rep}", plain, blocks)
            verified = timed_load(dec, f"checked-{rep}", checked, blocks)
            t0 = time.perf_counter()
            checksum_blocks(src, ids)
            handover = time.perf_counter() - t0
            if rep:
                times["read"].append(read)
                times["verified"].append(verified)
                times["handover"].append(handover)
        med = {k: statistics.median(v) for k, v in times.items()}
        mbytes = blocks * page * buffers / 1e6
        return Row(
            blocks,
            block_mib,
            mbytes,
            med["read"] * 1e3,
            med["verified"] * 1e3,
            med["handover"] * 1e3,
            mbytes / 1e3 / med["handover"],
        )
    finally:
        dec.close()
        pre.close()


def headline(rows: list[Row]) -> dict[str, float]:
    def gmean(values: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in values) / len(values))

    return {
        "verified_over_read": round(gmean([r.verified_ms / r.read_ms for r in rows]), 3),
        "handover_over_read": round(gmean([r.handover_ms / r.read_ms for r in rows]), 3),
        "checksum_gb_per_s": round(gmean([r.checksum_gb_per_s for r in rows]), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=lambda t: [int(x) for x in t.split(",")], default=[16, 256])
    ap.add_argument("--block-mib", type=lambda t: [float(x) for x in t.split(",")], default=[0.25, 1.0])
    ap.add_argument("--buffers", type=int, default=4, help="cache buffers a block spans")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json-out", type=Path, help="also write every row here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [_one(b, mib, args.buffers, args.reps) for mib in args.block_mib for b in args.blocks]
    for r in rows:
        print(
            f"{r.blocks:>4} x {r.block_mib:g} MiB ({r.mbytes:.0f} MB): read {r.read_ms:.1f} ms, "
            f"verified {r.verified_ms:.1f} ms, hand-over checksum {r.handover_ms:.1f} ms "
            f"({r.checksum_gb_per_s:.2f} GB/s)"
        )
    result = headline(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": [asdict(r) for r in rows], **result}, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
