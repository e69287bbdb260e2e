"""What the machine can do at most, measured the way a decode step and a prefill use it, and
the two physical bounds that follow for a model (issue 37's targets):

- memory read bandwidth: `torch.sum` over a buffer of a given size (a model's weights: out
  of every cache), on a given number of torch threads, best of a few runs;
- fp32 matmul peak: a large matmul on the same threads, both plain `torch.mm` and oneDNN's
  packed linear (`_reorder_linear_weight` / `_linear_pointwise`, the path models/layers.py
  runs on CPU), the higher of the two;
- TPOT bound: the weight bytes one decode step at batch 1 reads (the tied or separate LM head
  and every layer; of the routed experts only the active ones) over that bandwidth;
- TTFT bound: a prompt's FLOPs (2 x matmul parameters x tokens, the LM head for the last
  token, causal attention) over that peak. Recurrences (Mamba2 scans) are not counted: the
  bound is a lower one.

Benchmarks print the CPU's model name and the flags its kernels depend on first
(`cpu_line`), so a number always comes with the instruction set it was made on.

    python -m bench.machine [--threads 2] [--bytes 2.4e9] [--model DIR] [--prompt-tokens 128]

prints the CPU line, then one JSON line (bandwidth, peak, and the bounds where a model is given).
Measure on a quiet machine: the bounds are only as good as the two measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.ops import cpu_features, cpuinfo_field

# The flags the kernels and the engines' matmuls depend on, in the order they are printed.
FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_REPO = Path(__file__).resolve().parent.parent


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The `model name` line of a /proc/cpuinfo text (None: this machine's); "unknown CPU" where
    there is none."""
    return cpuinfo_field("model name", cpuinfo) or "unknown CPU"


def flags_line(model: str, cores: int, features: frozenset[str]) -> str:
    """One printable line: the CPU, its core count, and which of FLAGS it has (+) and lacks (-)."""
    marks = " ".join(("+" if f in features else "-") + f for f in FLAGS)
    return f"cpu: {model}, {cores} cores; flags: {marks}"


def cpu_flags(features: frozenset[str] | None = None) -> dict[str, bool]:
    """FLAGS with whether this CPU (or `features`) has each."""
    have = cpu_features() if features is None else features
    return {f: f in have for f in FLAGS}


def cpu_line() -> str:
    return flags_line(cpu_model_name(), os.cpu_count() or 1, cpu_features())


def read_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Bytes per second `torch.sum` reads from a buffer of `nbytes` (fp32) on `threads`
    threads, best of `repeats`: a decode step at batch 1 does little else than stream its
    weights once, and a reduction is the cheapest complete read torch has."""
    torch.set_num_threads(threads)
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)  # ones: every page is touched before timing
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.sum(buf)
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def matmul_peak(threads: int, rows: int = 1024, size: int = 4096, repeats: int = 3) -> float:
    """fp32 FLOP/s of a (rows x size) @ (size x size) matmul on `threads` threads, best of
    `repeats` over plain `torch.mm` and oneDNN's packed linear, whichever is faster."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, size, generator=gen)
    w = torch.randn(size, size, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    runs = {
        "mm": lambda: torch.mm(x, w.t()),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    best = math.inf
    for run in runs.values():
        run()  # first call: oneDNN builds its primitive
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return 2.0 * rows * size * size / best


@dataclasses.dataclass(frozen=True, slots=True)
class ModelCost:
    """What one token costs a model, counted from its checkpoint: the weight bytes a decode
    step at batch 1 reads, the matmul parameters each prompt token multiplies by (the LM
    head apart: a prefill computes logits for its last token only), and its attention."""

    weight_bytes_per_token: int
    matmul_params: int
    lm_head_params: int
    attention_layers: int
    attention_width: int  # query heads x head_dim

    def tpot_bound_s(self, bandwidth: float) -> float:
        return self.weight_bytes_per_token / bandwidth

    def prompt_flops(self, tokens: int) -> float:
        attention = 2.0 * self.attention_layers * self.attention_width * tokens * (tokens + 1)  # QK and PV, causal
        return 2.0 * self.matmul_params * tokens + 2.0 * self.lm_head_params + attention

    def ttft_bound_s(self, tokens: int, peak: float) -> float:
        return self.prompt_flops(tokens) / peak


def cost_from_tensors(
    shapes: dict[str, tuple[int, ...]], itemsize: int, config: dict[str, Any], active_expert_share: float
) -> ModelCost:
    """`shapes`: every checkpoint tensor's name and shape. Embeddings are gathered (one row a
    token); a tied LM head is the embedding read whole; routed experts (`experts.`, not
    `shared_experts.`) are read and multiplied in `active_expert_share`."""
    tied = bool(config.get("tie_word_embeddings", False))
    embed = lm_head = matmul = other = experts = 0
    attention_layers = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name.endswith(("embed_tokens.weight", "embeddings.weight")):  # Qwen's, NemotronH's
            embed += n
        elif name.endswith("lm_head.weight"):
            lm_head += n
        elif ".experts." in name and "shared_experts" not in name:
            experts += n
        elif len(shape) == 2:
            matmul += n
            attention_layers += name.endswith("q_proj.weight")
        else:
            other += n
    if tied and not lm_head:
        lm_head = embed
    active_experts = round(experts * active_expert_share)
    read = matmul + other + active_experts + lm_head + (0 if tied else embed // int(config["vocab_size"]))
    width = int(config["num_attention_heads"]) * int(config["head_dim"])
    return ModelCost(
        weight_bytes_per_token=read * itemsize,
        matmul_params=matmul + active_experts,
        lm_head_params=lm_head,
        attention_layers=attention_layers,
        attention_width=width,
    )


def active_expert_share(config: dict[str, Any]) -> float:
    """Share of the routed experts one token runs: top-k of all (NemotronH's
    `n_routed_experts`, Qwen3-MoE's `num_experts`); 1.0 where the config names none. A
    NemotronH config names them even without `moe` layers: there are no expert tensors then."""
    total = config.get("n_routed_experts") or config.get("num_experts")
    top = config.get("num_experts_per_tok")
    return int(top) / int(total) if total and top else 1.0


def model_cost(model_dir: Path) -> ModelCost:
    """ModelCost of the HF checkpoint at `model_dir` (config.json and its safetensors; fp32
    unless the tensors say otherwise). A Qwen3.5-style config keeps its text model's
    settings in `text_config`."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config") or config
    shapes: dict[str, tuple[int, ...]] = {}
    itemsize = 4
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                sl = f.get_slice(key)
                shapes[key] = tuple(sl.get_shape())
                itemsize = _ITEMSIZE.get(sl.get_dtype(), 4)
    return cost_from_tensors(shapes, itemsize, config, active_expert_share(config))


_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    bandwidth_bytes_s: float
    matmul_peak_flops: float
    threads: int
    buffer_bytes: int


def measure(nbytes: int, threads: int, cpus: str | None = None) -> Measured:
    """Both measurements in a fresh process of their own on `cpus` (taskset list; default the
    first `threads` cores, where the engines' compute threads run): the caller's own torch
    threads, allocations and CPU affinity stay as they were."""
    cpus = cpus or f"0-{threads - 1}"
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "bench.machine"]
    out = subprocess.run(
        [*cmd, "--bytes", str(nbytes), "--threads", str(threads), "--no-cpu-line"],
        capture_output=True,
        text=True,
        check=True,
        cwd=_REPO,
    ).stdout
    data = json.loads(out.strip().splitlines()[-1])
    return Measured(data["bandwidth_bytes_s"], data["matmul_peak_flops"], threads, nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bytes", type=float, default=2.4e9, help="buffer size of the bandwidth measurement")
    ap.add_argument("--model", type=Path, help="an HF checkpoint directory: also print its TPOT and TTFT bounds")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--no-cpu-line", action="store_true", help="print the JSON line only")
    args = ap.parse_args()
    if args.threads < 1 or args.bytes < 4 or args.prompt_tokens < 1:
        ap.error("--threads and --prompt-tokens must be >= 1, --bytes >= 4")
    if args.model is not None and not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    if not args.no_cpu_line:
        print(cpu_line(), flush=True)
    bandwidth = read_bandwidth(int(args.bytes), args.threads)
    peak = matmul_peak(args.threads)
    result: dict[str, object] = {
        "threads": args.threads,
        "buffer_bytes": int(args.bytes),
        "bandwidth_bytes_s": bandwidth,
        "matmul_peak_flops": peak,
    }
    if args.model is not None:
        cost = model_cost(args.model)
        result |= {
            "weight_bytes_per_token": cost.weight_bytes_per_token,
            "tpot_bound_ms": 1e3 * cost.tpot_bound_s(bandwidth),
            "ttft_bound_ms": 1e3 * cost.ttft_bound_s(args.prompt_tokens, peak),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
