"""Tensor parallelism: which heads a rank keeps, its local config, and its weight slices.

A rank runs the same model classes as a single process, built from a *local* config whose
head and width counts are the rank's share (`shard_config`, models/tp_shards.py), so the model code and the
cache layout need no TP branches: the local config alone sizes a rank's pages. Projections
into heads are column-parallel (rows of the weight split), projections out of heads are
row-parallel (columns split) and the models all-reduce each block's output before the
residual add. Embeddings, norms and the LM head are replicated: every rank ends a step
with the same logits.

A mixture of experts splits like the dense MLP: every rank holds every expert (and the shared
expert) with its share of the intermediate width, and the router, the shared expert's gate
and a latent projection into the experts are replicated. Its output is then a partial sum
like any block's, whichever experts the tokens chose, and every rank reads 1/N of each
picked expert's weights in a step (docs/design.md §11 has why not experts over ranks).

When TP exceeds a head count that cannot be split (attention KV heads, Gated DeltaNet key
heads, Mamba's single B/C group), each rank keeps the heads its query (value) heads read:
those are replicated, not split.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.tp_shards import even_share, split_heads


class TPGroup:
    """This rank's place in its tensor-parallel group; `size == 1` is a plain single process."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, reduced in fp32 so bf16 partial sums round once, as the
        single-process matmul does."""
        if self.size == 1:
            return x
        y = x.float().contiguous()
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)


SINGLE = TPGroup()
COLLECTIVE_TIMEOUT_S = 300


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the TP group (gloo on CPU, NCCL on CUDA); every rank calls it with the same method."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A rank that died leaves the others waiting in an all-reduce: the timeout turns that
    # into a failed step (and a failed engine, which is replaced) instead of a hang.
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    return TPGroup(rank, size, dist.group.WORLD)


Rule = Callable[[torch.Tensor], torch.Tensor]
# An expert's index in a tensor name, which the rules name as `experts.*`.
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _rows(spans: list[range], dim: int = 0) -> Rule:
    """Keep the given index ranges along `dim`, concatenated in order."""

    def take(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.narrow(dim, r.start, len(r)) for r in spans], dim=dim).contiguous()

    return take


def _scaled(r: range, width: int) -> range:
    return range(r.start * width, r.stop * width)


def _offset(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


def _rules(cfg: ModelConfig, rank: int, size: int) -> dict[str, Rule]:
    """Name suffix -> how that tensor is sliced for `rank`. Tensors no rule names are replicated."""
    rank0_only: Rule = (lambda t: t) if rank == 0 else torch.zeros_like  # a row-parallel bias adds once
    mlp = even_share(cfg.intermediate_size, rank, size, "intermediate_size")
    rules: dict[str, Rule] = {}
    for name in ("up_proj", "gate_proj"):
        rules[f"{name}.weight"] = rules[f"{name}.bias"] = _rows([mlp])
    rules["down_proj.weight"], rules["down_proj.bias"] = _rows([mlp], 1), rank0_only
    if cfg.attention_layers:
        heads = split_heads(cfg.num_attention_heads, cfg.num_key_value_heads, rank, size, "attention")
        d = cfg.head_dim
        # Qwen3.5's q_proj yields [query | gate] per head: twice the rows per head.
        q_width = 2 * d if cfg.architecture == "qwen3_5" else d
        rules["q_proj.weight"] = rules["q_proj.bias"] = _rows([_scaled(heads.q, q_width)])
        for name in ("k_proj", "v_proj"):
            rules[f"{name}.weight"] = rules[f"{name}.bias"] = _rows([_scaled(heads.kv, d)])
        rules["o_proj.weight"], rules["o_proj.bias"] = _rows([_scaled(heads.q, d)], 1), rank0_only
    if cfg.mamba is not None:
        rules |= _mamba_rules(cfg, rank, size, rank0_only)
    if cfg.gated_delta_net is not None:
        rules |= _gated_deltanet_rules(cfg, rank, size)
    if cfg.moe is not None:
        rules |= _moe_rules(cfg, rank, size, rank0_only)
    return rules


def _moe_rules(cfg: ModelConfig, rank: int, size: int, rank0_only: Rule) -> dict[str, Rule]:
    """Each expert's and the shared expert's intermediate width split as the dense MLP's;
    the latent projection out of the experts adds its bias once."""
    m = cfg.moe
    assert m is not None
    experts = even_share(m.intermediate_size, rank, size, "moe_intermediate_size")
    rules: dict[str, Rule] = {}
    for name in ("up_proj", "gate_proj"):
        rules[f"experts.*.{name}.weight"] = _rows([experts])
    rules["experts.*.down_proj.weight"] = _rows([experts], 1)
    if m.shared_intermediate_size:
        shared = even_share(m.shared_intermediate_size, rank, size, "shared_expert_intermediate_size")
        for module in ("shared_expert", "shared_experts"):
            for name in ("up_proj", "gate_proj"):
                rules[f"{module}.{name}.weight"] = rules[f"{module}.{name}.bias"] = _rows([shared])
            rules[f"{module}.down_proj.weight"], rules[f"{module}.down_proj.bias"] = _rows([shared], 1), rank0_only
    rules["fc2_latent_proj.bias"] = rank0_only
    return rules


def _mamba_rules(cfg: ModelConfig, rank: int, size: int, rank0_only: Rule) -> dict[str, Rule]:
    """in_proj yields [z | x | B | C | dt]; the conv runs over [x | B | C]. x and z split by
    head, B and C by group (or whole, for a single group), dt by head."""
    m = cfg.mamba
    assert m is not None
    heads = even_share(m.num_heads, rank, size, "mamba_num_heads")
    groups = even_share(m.n_groups, rank, size, "n_groups") if m.n_groups % size == 0 else range(m.n_groups)
    inner, bc = _scaled(heads, m.head_dim), _scaled(groups, m.state_size)
    xbc = [inner, _offset(bc, m.intermediate_size), _offset(bc, m.intermediate_size + m.n_groups * m.state_size)]
    in_proj = _rows(
        [inner, *(_offset(r, m.intermediate_size) for r in xbc), _offset(heads, m.intermediate_size + m.conv_dim)]
    )
    return {
        "in_proj.weight": in_proj,
        "in_proj.bias": in_proj,
        "mixer.conv1d.weight": _rows(xbc),
        "mixer.conv1d.bias": _rows(xbc),
        "mixer.dt_bias": _rows([heads]),
        "mixer.A_log": _rows([heads]),
        "mixer.D": _rows([heads]),
        "mixer.norm.weight": _rows([inner]),
        "mixer.out_proj.weight": _rows([inner], 1),
        "mixer.out_proj.bias": rank0_only,
    }


def _gated_deltanet_rules(cfg: ModelConfig, rank: int, size: int) -> dict[str, Rule]:
    """in_proj_qkv yields [q | k | v] (the conv runs over the same): q and k by key head, v by
    value head; z, a, b by value head."""
    g = cfg.gated_delta_net
    assert g is not None
    heads = split_heads(g.num_v_heads, g.num_k_heads, rank, size, "linear attention")
    keys, values = _scaled(heads.kv, g.head_k_dim), _scaled(heads.q, g.head_v_dim)
    qkv = _rows([keys, _offset(keys, g.key_dim), _offset(values, 2 * g.key_dim)])
    return {
        "in_proj_qkv.weight": qkv,
        "linear_attn.conv1d.weight": qkv,
        "in_proj_z.weight": _rows([values]),
        "in_proj_a.weight": _rows([heads.q]),
        "in_proj_b.weight": _rows([heads.q]),
        "linear_attn.dt_bias": _rows([heads.q]),
        "linear_attn.A_log": _rows([heads.q]),
        "linear_attn.out_proj.weight": _rows([values], 1),
    }


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """The full checkpoint's tensors cut to rank `rank`'s share (`cfg` is the full config)."""
    if size == 1:
        return weights
    rules = _rules(cfg, rank, size)
    # The most specific rule first: an expert's `up_proj` is not the dense MLP's.
    ordered = sorted(rules.items(), key=lambda item: -len(item[0]))
    out = {}
    for name, t in weights.items():
        generic = _EXPERT_INDEX.sub(".experts.*.", name)
        rule = next((r for suffix, r in ordered if generic.endswith("." + suffix)), None)
        out[name] = rule(t) if rule is not None else t
    return out
