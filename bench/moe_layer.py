"""The MoE layer (models/moe.py) against the two obvious ways to compute it, in CPU time on one
thread: a loop over each token's experts, and transformers' eager expert loop (a one-hot mask,
then each expert hit on its tokens, `index_add_` back), both on the same weights. Then the
load a rank would carry if experts were spread over ranks instead of split by width: the
busiest rank's picked experts over the mean, for uniform routing (docs/design.md §11).

    python -m bench.moe_layer [--hidden 1024] [--experts 64] [--top-k 8] [--width 256]
                              [--tokens 1 4 32 256] [--json-out FILE]

CPU time, not wall time: on a shared machine other processes stretch the wall clock, not the
work done. docs/design.md §20 has the results on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from models.config import ModelConfig
from models.layers import pack_linears, stack_projections
from models.mlp import GatedMLP
from models.moe import MoE


def _layer(hidden: int, experts: int, top_k: int, width: int) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """A served Qwen3-MoE layer (stacked, packed) and its experts' weights as [E, out, in]."""
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": 8,
            "hidden_size": hidden,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "intermediate_size": 8,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": width,
            "norm_topk_prob": True,
        }
    )
    moe = MoE(cfg).eval()
    for p in moe.parameters():
        nn.init.normal_(p, std=0.05)
    experts_ = [cast(GatedMLP, e) for e in moe.experts]
    gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts_]).detach()
    down = torch.stack([e.down_proj.weight for e in experts_]).detach()
    stack_projections(moe)
    pack_linears(moe)
    return moe, gate_up, down


def _per_token(moe: MoE, gate_up: torch.Tensor, down: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.gate(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                g, u = F.linear(x[t], gate_up[e]).chunk(2)
                out[t] += weights[t, k] * F.linear(F.silu(g) * u, down[e])
        return out

    return run


def _expert_loop(moe: MoE, gate_up: torch.Tensor, down: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' eager experts (its `Qwen3MoeExperts.forward`), written out."""

    def run(x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.gate(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)
        for e in (mask.sum(dim=(-1, -2)) > 0).nonzero()[:, 0]:
            pos, tok = torch.where(mask[e])
            g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * weights[tok, pos, None])
        return out

    return run


def _cpu_ms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    """Best of three runs of `reps` calls, CPU milliseconds a call."""
    fn(x)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(reps):
            fn(x)
        best = min(best, (time.process_time() - start) / reps)
    return best * 1e3


def expert_parallel_imbalance(experts: int, top_k: int, ranks: int, tokens: int, draws: int = 2000) -> float:
    """Mean over draws of the busiest rank's picked experts over the mean rank's, experts
    spread evenly over `ranks` and each token picking `top_k` uniformly."""
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for _ in range(draws):
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
        hit = torch.zeros(experts, dtype=torch.bool)
        hit[ids.flatten()] = True
        per_rank = hit.view(ranks, experts // ranks).sum(1).float()
        total += (per_rank.max() / per_rank.mean()).item()
    return total / draws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32, 256])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    moe, gate_up, down = _layer(args.hidden, args.experts, args.top_k, args.width)
    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "moe_layer": moe,
        "per_token": _per_token(moe, gate_up, down),
        "expert_loop": _expert_loop(moe, gate_up, down),
    }
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden)
            want = ways["per_token"](x)
            assert (moe(x) - want).abs().max().item() < 1e-3, "the layer and the per-token loop disagree"
            row: dict[str, float] = {"tokens": tokens}
            for name, fn in ways.items():
                row[f"{name}_ms"] = _cpu_ms(fn, x, max(1, (8 if name == "per_token" else 64) // tokens))
            rows.append(row)
            print(
                f"{tokens:5d} tokens: layer {row['moe_layer_ms']:8.2f} ms, per-token loop {row['per_token_ms']:8.2f} ms "
                f"({row['per_token_ms'] / row['moe_layer_ms']:.1f}x), expert loop {row['expert_loop_ms']:8.2f} ms "
                f"({row['expert_loop_ms'] / row['moe_layer_ms']:.2f}x)"
            )
    imbalance = {b: expert_parallel_imbalance(256, 8, 2, b) for b in (1, 8, 64)}
    for b, r in imbalance.items():
        print(f"experts over 2 ranks, top 8 of 256, {b} tokens: busiest rank {r:.2f}x the mean")
    if args.json_out:
        args.json_out.write_text(json.dumps({"layer": rows, "expert_parallel_imbalance": imbalance}, indent=2) + "\n")


if __name__ == "__main__":
    main()
