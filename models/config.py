"""Model configuration read from a Hugging Face `config.json`.

Only the fields the engine needs are kept, in one frozen record shared by both supported
architectures, so the cache layout and the workers can reason about a model without
knowing which class implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

LayerKind = Literal["attention", "mamba", "mlp"]

ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h", "Qwen3ForCausalLM": "qwen3"}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp"}
_BLOCK_TYPES = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "mamba": "mamba",
                "attention": "attention"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A config.json the engine cannot serve; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Mamba2 mixer dimensions; the state shapes derived here size the cache pages."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    time_step_min: float
    use_conv_bias: bool

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: Literal["nemotron_h", "qwen3"]
    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[LayerKind, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    use_bias: bool
    rope_theta: float | None
    mamba: MambaSpec | None
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: torch.dtype

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "attention")

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mamba")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = {"nemotron_h": "nemotron_h", "qwen3": "qwen3"}.get(d.get("model_type", ""))
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}"
            )
        try:
            return _parse_nemotron_h(d) if arch == "nemotron_h" else _parse_qwen3(d)
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None


def _first_id(v: Any) -> int | None:
    return v[0] if isinstance(v, list) and v else v if isinstance(v, int) else None


def _dtype(d: dict[str, Any]) -> torch.dtype:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


def _common(d: dict[str, Any]) -> dict[str, Any]:
    heads = d["num_attention_heads"]
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        eos_token_id=_first_id(d.get("eos_token_id")),
        bos_token_id=_first_id(d.get("bos_token_id")),
        pad_token_id=_first_id(d.get("pad_token_id")),
        dtype=_dtype(d),
    )


def _parse_nemotron_h(d: dict[str, Any]) -> ModelConfig:
    if "hybrid_override_pattern" in d:
        bad = set(d["hybrid_override_pattern"]) - set(_PATTERN)
        if bad:
            raise ConfigError(f"hybrid_override_pattern has unsupported layer symbols {sorted(bad)}")
        kinds = tuple(_PATTERN[c] for c in d["hybrid_override_pattern"])
    else:
        types = d["layers_block_type"]
        bad = set(types) - set(_BLOCK_TYPES)
        if bad:
            raise ConfigError(f"layers_block_type has unsupported layer types {sorted(bad)}")
        kinds = tuple(_BLOCK_TYPES[t] for t in types)
    mamba = MambaSpec(
        num_heads=d["mamba_num_heads"],
        head_dim=d["mamba_head_dim"],
        state_size=d["ssm_state_size"],
        n_groups=d.get("n_groups", d.get("mamba_n_groups", 1)),
        conv_kernel=d.get("conv_kernel", d.get("mamba_d_conv", 4)),
        chunk_size=d.get("chunk_size", d.get("mamba_chunk_size", 128)),
        time_step_min=float(d.get("time_step_min", d.get("mamba_dt_min", 0.001))),
        use_conv_bias=bool(d.get("use_conv_bias", d.get("mamba_conv_bias", True))),
    )
    return ModelConfig(
        architecture="nemotron_h",
        layer_kinds=kinds,
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        mlp_bias=bool(d.get("mlp_bias", False)),
        use_bias=bool(d.get("use_bias", False)),
        rope_theta=None,
        mamba=mamba,
        **_common(d),
    )


def _parse_qwen3(d: dict[str, Any]) -> ModelConfig:
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported rope_type {rope['rope_type']!r}; only 'default' is implemented")
    if d.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    return ModelConfig(
        architecture="qwen3",
        layer_kinds=("attention",) * d["num_hidden_layers"],
        norm_eps=d.get("rms_norm_eps", 1e-6),
        mlp_bias=False,
        use_bias=False,
        rope_theta=float(theta),
        mamba=None,
        **_common(d),
    )
