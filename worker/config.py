"""What a worker is built from.

Its own module, free of torch: the engine actor fills one per rank and sends it over Ray, and
the engine process never loads torch (docs/design.md §14).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker is built from; it crosses Ray as plain data."""

    model_dir: str
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"  # or "auto": cuda where the worker runs has one, else cpu
    cpus: tuple[int, ...] = ()  # the CPUs the compute thread is bound to; none: not bound
    cpu_kernels: bool = True  # the C++ kernels on a CPU (kernels/cpu/ops.py)
    cpu_vectors: str = "auto"  # their vector path: auto, avx2 or avx512 (kernels/cpu/ops.py decide)
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    seed: int = 0
    stream_delay_s: float = 0.0  # tests: make the compute stream lag
    kv_role: Literal["colocated", "prefill", "decode"] = "colocated"
    engine_id: str = ""
    # The worker's NIXL agent (prefill and decode roles): chosen by the engine, which names it
    # in the KVTransferParams it hands out.
    nixl_agent_name: str = ""
    kv_fail_fraction: float = 0.0  # tests: fail this share of KV loads
    kv_transfer_timeout_s: float = 30.0
    kv_delay_s: float = 0.0  # tests: hold each KV READ back this long
    kv_verify: bool = False  # prefill: checksum handed-over blocks (kv/nixl/verify.py)
    kv_corrupt_fraction: float = 0.0  # tests: corrupt this share of landed loads
    kv_verify_tp: int = 1  # prefill under --kv-verify: the decode engines' TP size (what each rank READs)
    # Tensor parallelism: this worker's rank among its engine's workers, and where they meet
    # (a `tcp://host:port` torch.distributed init method; unused when tp_size is 1).
    tp_rank: int = 0
    tp_size: int = 1
    tp_init_method: str = ""
