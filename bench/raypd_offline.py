"""raypd's offline half of `bench.peers`: the in-process engine (the scheduler and worker
classes of the deployment, no Ray) serving the same stdin commands as
`bench/vllm_offline.py`, so the driver runs both engines alike: each in a process and
session of its own (Linux shares CPU time fairly between sessions, so an engine inside
the driver's session would compete with everything else started from there):

    {"prompts": [[token ids], ...], "batch": 32, "max_tokens": 64, "out": "/path/result.json"}

    python -m bench.raypd_offline --model DIR --max-num-seqs 32 --threads 1 --kv-cache-gib 2

`RAYPD_*` variables apply as they do to the server (serve/config.py), e.g. RAYPD_CPU_VECTORS=avx2
runs the kernels' AVX2 path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import torch

from actors.process import freeze_startup_objects
from engine.core import EngineCore
from engine.local import build_local_engine
from engine.messages import SamplingParams
from serve.config import config_from


async def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for req_id, prompt in zip(ids, prompts, strict=False):
        core.add_request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    pending = set(ids)
    while pending:
        for batch in await core.get_outputs(timeout=60):
            for out in batch:
                tokens[out.req_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    pending.discard(out.req_id)
    return [tokens[i] for i in ids]


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    # The forward on the cores vLLM's compute threads are bound to (bench/peer_servers.vllm_env).
    # These fields over the server's other layers (RAYPD_* variables: --cpu-vectors among them).
    fields = argparse.Namespace(
        model=args.model,
        dtype="float32",
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        seed=0,
        worker_cpus=f"0-{args.threads - 1}",
        kv_cache_memory=f"{args.kv_cache_gib}GiB",
    )
    cfg = config_from(fields)
    core, worker = build_local_engine(cfg)
    freeze_startup_objects()  # as the worker and engine actors do
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            prompts, batch = cmd["prompts"], cmd["batch"]
            outputs: list[list[int]] = []
            start = time.perf_counter()
            for i in range(0, len(prompts), batch):
                outputs += await generate(core, prompts[i : i + batch], cmd["max_tokens"])
            wall = time.perf_counter() - start
            tmp = cmd["out"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"wall_s": wall, "token_ids": outputs}, f)
            os.replace(tmp, cmd["out"])
    finally:
        await core.close()
        worker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--kv-cache-gib", type=int, required=True, help="KV cache memory, as vLLM's VLLM_CPU_KVCACHE_SPACE")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
