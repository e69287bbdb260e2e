"""Model configuration read from a Hugging Face `config.json`.

Only the fields the engine needs are kept, in one frozen record shared by both supported
architectures, so the cache layout and the workers can reason about a model without
knowing which class implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from models.dtypes import DTYPE_BYTES

LayerKind = Literal["attention", "mamba", "mlp"]

ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h", "Qwen3ForCausalLM": "qwen3", "Qwen3_5ForCausalLM": "qwen3_5"}
_MODEL_TYPES = {"nemotron_h": "nemotron_h", "qwen3": "qwen3", "qwen3_5_text": "qwen3_5"}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp"}
_BLOCK_TYPES = {
    "linear_attention": "mamba",
    "full_attention": "attention",
    "mlp": "mlp",
    "mamba": "mamba",
    "attention": "attention",
}


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
    # The gated norm's group width when it is not this spec's own `intermediate_size //
    # n_groups`: a tensor-parallel rank's share of a group that spans every rank.
    norm_group_size: int | None = None

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.norm_group_size or self.intermediate_size // self.n_groups

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
class GatedDeltaNetSpec:
    """Gated DeltaNet (Qwen3.5 linear attention) dimensions. Its per-request state has the
    same two parts as Mamba2's, a causal-conv window and a recurrent matrix per value head,
    so it lives in the same kind of state page."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: Literal["nemotron_h", "qwen3", "qwen3_5"]
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
    dtype: str  # a name in models.dtypes.DTYPE_BYTES
    gated_delta_net: GatedDeltaNetSpec | None = None
    partial_rotary_factor: float = 1.0

    @property
    def state_spec(self) -> MambaSpec | GatedDeltaNetSpec | None:
        """What sizes a state page: the conv and recurrent state shapes of the state layers."""
        return self.mamba or self.gated_delta_net

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
            arch = _MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}"
            )
        try:
            return {"nemotron_h": _parse_nemotron_h, "qwen3": _parse_qwen3, "qwen3_5": _parse_qwen3_5}[arch](d)
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None


def _first_id(v: Any) -> int | None:
    return v[0] if isinstance(v, list) and v else v if isinstance(v, int) else None


def _dtype(d: dict[str, Any]) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unsupported dtype {name!r}; supported: {sorted(DTYPE_BYTES)}")
    return str(name)


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


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported rope_type {rope['rope_type']!r}; only 'default' is implemented")
    return rope


def _parse_qwen3(d: dict[str, Any]) -> ModelConfig:
    rope = _rope(d)
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


def _parse_qwen3_5(d: dict[str, Any]) -> ModelConfig:
    """Qwen3.5's text decoder. Its multimodal RoPE sections are accepted and ignored: for
    text the three position streams are equal, and the interleaving then changes nothing."""
    rope = _rope(d)
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
    layers = d["num_hidden_layers"]
    # transformers' default when a config names no layer types: every 4th layer is full attention.
    interval = d.get("full_attention_interval", 4)
    types = d.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    bad = set(types) - {"linear_attention", "full_attention"}
    if bad:
        raise ConfigError(f"layer_types has unsupported layer types {sorted(bad)}")
    if len(types) != layers:
        raise ConfigError(f"layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    gdn = GatedDeltaNetSpec(
        num_k_heads=d.get("linear_num_key_heads", 16),
        num_v_heads=d.get("linear_num_value_heads", 32),
        head_k_dim=d.get("linear_key_head_dim", 128),
        head_v_dim=d.get("linear_value_head_dim", 128),
        conv_kernel=d.get("linear_conv_kernel_dim", 4),
    )
    if gdn.num_v_heads % gdn.num_k_heads:
        raise ConfigError(
            f"linear_num_value_heads ({gdn.num_v_heads}) must be a multiple of linear_num_key_heads ({gdn.num_k_heads})"
        )
    factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    common = _common(d)
    if not 0 < factor <= 1 or int(common["head_dim"] * factor) % 2:
        raise ConfigError(f"partial_rotary_factor {factor} must give an even rotary width within head_dim")
    return ModelConfig(
        architecture="qwen3_5",
        layer_kinds=tuple(_BLOCK_TYPES[t] for t in types),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        mlp_bias=False,
        use_bias=False,
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        mamba=None,
        gated_delta_net=gdn,
        partial_rotary_factor=factor,
        **common,
    )
