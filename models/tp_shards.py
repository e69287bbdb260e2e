"""Which heads and widths a tensor-parallel rank keeps, as a config (the scheme is in
models/tensor_parallel.py).

Torch-free: the engine checks a TP size against the model's heads before any worker starts,
and the KV transfer maps pages between TP sizes, from these alone (docs/design.md §14).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from models.config import ConfigError, ModelConfig


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """A rank's query heads and the KV heads they read (the KV range is shared by several
    ranks when there are fewer KV heads than ranks)."""

    q: range
    kv: range


def split_heads(num_heads: int, num_kv_heads: int, rank: int, size: int, what: str) -> HeadSplit:
    if num_heads % size:
        raise ConfigError(f"{what}: {num_heads} heads do not split over tensor parallel size {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ConfigError(
            f"{what}: {num_kv_heads} KV heads neither split over nor replicate evenly to tensor parallel size {size}"
        )
    per = num_heads // size
    group = num_heads // num_kv_heads
    q = range(rank * per, (rank + 1) * per)
    return HeadSplit(q, range(q.start // group, (q.stop - 1) // group + 1))


def even_share(n: int, rank: int, size: int, what: str) -> range:
    """Rank `rank`'s equal share of `n` units, or a ConfigError naming `what` if they do not split."""
    if n % size:
        raise ConfigError(f"{what} ({n}) does not split over tensor parallel size {size}")
    per = n // size
    return range(rank * per, (rank + 1) * per)


def shard_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The config of rank `rank`'s share of the model: what its modules and pages are sized by."""
    if size == 1:
        return cfg
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside tensor parallel size {size}")
    local: dict[str, Any] = {
        "intermediate_size": len(even_share(cfg.intermediate_size, rank, size, "intermediate_size"))
    }
    if cfg.attention_layers:
        heads = split_heads(cfg.num_attention_heads, cfg.num_key_value_heads, rank, size, "attention")
        local |= {"num_attention_heads": len(heads.q), "num_key_value_heads": len(heads.kv)}
    if cfg.mamba is not None:
        m = cfg.mamba
        mamba_heads = len(even_share(m.num_heads, rank, size, "mamba_num_heads"))
        if m.n_groups % size == 0:
            mamba = dataclasses.replace(m, num_heads=mamba_heads, n_groups=m.n_groups // size)
        elif m.n_groups == 1:
            # One B/C group for all heads: every rank keeps it, and the gated norm, whose
            # group spans every head, sums its squares across the ranks.
            mamba = dataclasses.replace(m, num_heads=mamba_heads, norm_group_size=m.intermediate_size)
        else:
            raise ConfigError(f"mamba n_groups ({m.n_groups}) must be 1 or a multiple of tensor parallel size {size}")
        local["mamba"] = mamba
    if cfg.gated_delta_net is not None:
        g = cfg.gated_delta_net
        linear = split_heads(g.num_v_heads, g.num_k_heads, rank, size, "linear attention")
        local["gated_delta_net"] = dataclasses.replace(g, num_v_heads=len(linear.q), num_k_heads=len(linear.kv))
    if cfg.moe is not None:
        e = cfg.moe
        local["moe"] = dataclasses.replace(
            e,
            intermediate_size=len(even_share(e.intermediate_size, rank, size, "moe_intermediate_size")),
            shared_intermediate_size=len(
                even_share(e.shared_intermediate_size, rank, size, "shared_expert_intermediate_size")
            ),
        )
    return dataclasses.replace(cfg, **local)
