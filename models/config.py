"""Model configuration read from a Hugging Face `config.json`.

Only the fields the engine needs are kept, in one frozen record shared by the supported
architectures, so the cache layout and the workers can reason about a model without
knowing which class implements it. A mixture-of-experts variant is its dense family's
architecture with a `MoESpec`: experts replace the MLP, never the token mixer, so the
cache layout does not change. A multimodal wrapper (`…ForConditionalGeneration`) is read
as its `text_config`: only the language model is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from models.dtypes import DTYPE_BYTES

LayerKind = Literal["attention", "mamba", "mlp", "moe"]
Architecture = Literal["nemotron_h", "qwen3", "qwen3_5"]

# Each served class: its architecture and whether its MLPs are mixtures of experts (a
# NemotronH is one where its `layers_block_type` has `moe` layers).
ARCHITECTURES: dict[str, tuple[Architecture, bool]] = {
    "NemotronHForCausalLM": ("nemotron_h", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "Qwen3MoeForCausalLM": ("qwen3", True),
    "Qwen3_5ForCausalLM": ("qwen3_5", False),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", False),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", True),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", True),
}
_MODEL_TYPES: dict[str, tuple[Architecture, bool]] = {
    "nemotron_h": ("nemotron_h", False),
    "qwen3": ("qwen3", False),
    "qwen3_moe": ("qwen3", True),
    "qwen3_5": ("qwen3_5", False),
    "qwen3_5_text": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5", True),
    "qwen3_5_moe_text": ("qwen3_5", True),
}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_TYPES = {
    "linear_attention": "mamba",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
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
class MoESpec:
    """A mixture-of-experts MLP as transformers computes it: a router picks `top_k` of
    `num_experts` experts per token, their outputs are summed with the router's weights, and a
    shared expert (when `shared_intermediate_size`) adds its output for every token.

    Qwen (`scoring="softmax"`): softmax over the experts, the top k renormalised when
    `norm_topk_prob`, SwiGLU experts, the shared expert scaled by sigmoid(`shared_expert_gate`)
    where there is one. NemotronH (`scoring="sigmoid"`): sigmoid scores, the choice made on
    scores plus `e_score_correction_bias` within the best `topk_group` of `n_group` groups
    (a group's score: its two best), the chosen scores renormalised when `norm_topk_prob` and
    scaled by `routed_scaling_factor`; relu² experts, run in a `latent_size` space when set."""

    layers: tuple[int, ...]  # the layers whose MLP is this mixture
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int  # 0: no shared expert
    scoring: Literal["softmax", "sigmoid"]
    norm_topk_prob: bool
    gated: bool  # SwiGLU experts (Qwen) rather than relu² (NemotronH)
    shared_expert_gate: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    latent_size: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: Architecture
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
    moe: MoESpec | None = None

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

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        found = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if found is None:
            found = _MODEL_TYPES.get(d.get("model_type", ""))
        if found is None:
            raise ConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}"
            )
        arch, moe = found
        try:
            d = _text_config(d)
            if arch == "nemotron_h":
                return _parse_nemotron_h(d)
            return (_parse_qwen3 if arch == "qwen3" else _parse_qwen3_5)(d, moe)
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's language model config: its `text_config`, with the fields the
    wrapper keeps at the top (whether the LM head is tied to the embedding, the dtype)."""
    if "text_config" not in d:
        return d
    text = d["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be an object, not {type(text).__name__}")
    top = {k: d[k] for k in ("tie_word_embeddings", "dtype", "torch_dtype") if k in d}
    return {**text, **top}


def _first_id(v: Any) -> int | None:
    return v[0] if isinstance(v, list) and v else v if isinstance(v, int) else None


def _dtype(d: dict[str, Any]) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unsupported dtype {name!r}; supported: {sorted(DTYPE_BYTES)}")
    return str(name)


def _common(d: dict[str, Any], dense_mlp: bool = True) -> dict[str, Any]:
    """The fields every architecture reads; `dense_mlp=False` where no layer has a dense MLP
    (Qwen3.5-MoE), whose config then needs no `intermediate_size`."""
    heads = d["num_attention_heads"]
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"] if dense_mlp else d.get("intermediate_size", 0),
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
    if d.get("mlp_hidden_act", "relu2") != "relu2":
        raise ConfigError(f"unsupported mlp_hidden_act {d['mlp_hidden_act']!r}; only 'relu2' is implemented")
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
    moe_layers = tuple(i for i, k in enumerate(kinds) if k == "moe")
    return ModelConfig(
        architecture="nemotron_h",
        layer_kinds=kinds,
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        mlp_bias=bool(d.get("mlp_bias", False)),
        use_bias=bool(d.get("use_bias", False)),
        rope_theta=None,
        mamba=mamba,
        moe=_nemotron_h_moe(d, moe_layers) if moe_layers else None,
        **_common(d, dense_mlp="mlp" in kinds),
    )


def _nemotron_h_moe(d: dict[str, Any], layers: tuple[int, ...]) -> MoESpec:
    latent = d.get("moe_latent_size")
    spec = MoESpec(
        layers=layers,
        num_experts=d.get("n_routed_experts", d.get("num_local_experts", 8)),
        top_k=d.get("num_experts_per_tok", 2),
        intermediate_size=d["moe_intermediate_size"],
        shared_intermediate_size=d.get("moe_shared_expert_intermediate_size", d["moe_intermediate_size"]),
        scoring="sigmoid",
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        gated=False,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        n_group=d.get("n_group", 1),
        topk_group=d.get("topk_group", 1),
        latent_size=int(latent) if latent is not None else None,
    )
    _check_moe(spec)
    if spec.num_experts % spec.n_group:
        raise ConfigError(f"n_group ({spec.n_group}) does not divide n_routed_experts ({spec.num_experts})")
    if not 1 <= spec.topk_group <= spec.n_group:
        raise ConfigError(f"topk_group ({spec.topk_group}) must be between 1 and n_group ({spec.n_group})")
    per_group = spec.num_experts // spec.n_group
    if per_group < 2 and spec.n_group > 1:
        raise ConfigError(
            f"n_group ({spec.n_group}) leaves fewer than two experts a group (a group scores its best two)"
        )
    if spec.top_k > spec.topk_group * per_group:
        raise ConfigError(
            f"num_experts_per_tok ({spec.top_k}) exceeds the {spec.topk_group * per_group} experts of topk_group groups"
        )
    return spec


def _qwen_moe(d: dict[str, Any], layers: tuple[int, ...], shared: bool) -> MoESpec:
    """Qwen3-MoE (no shared expert) and Qwen3.5-MoE (a shared expert with a sigmoid gate)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
    spec = MoESpec(
        layers=layers,
        num_experts=d.get("num_experts", d.get("num_local_experts", 0)),
        top_k=d["num_experts_per_tok"],
        intermediate_size=d["moe_intermediate_size"],
        shared_intermediate_size=d["shared_expert_intermediate_size"] if shared else 0,
        scoring="softmax",
        # Qwen3.5-MoE's router always renormalises the top k; Qwen3-MoE's when asked.
        norm_topk_prob=True if shared else bool(d.get("norm_topk_prob", False)),
        gated=True,
        shared_expert_gate=shared,
    )
    _check_moe(spec)
    return spec


def _check_moe(spec: MoESpec) -> None:
    if spec.num_experts < 1:
        raise ConfigError(f"num_experts ({spec.num_experts}) must be at least 1")
    if not 1 <= spec.top_k <= spec.num_experts:
        raise ConfigError(f"num_experts_per_tok ({spec.top_k}) must be between 1 and the {spec.num_experts} experts")
    if spec.intermediate_size < 1:
        raise ConfigError(f"moe_intermediate_size ({spec.intermediate_size}) must be at least 1")


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters`, or transformers 4's `rope_scaling` (released Qwen3 configs still
    write it): a scaled RoPE (YaRN, linear, ...) is refused, not run unscaled."""
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported rope_type {rope['rope_type']!r}; only 'default' is implemented")
    scaling = d.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if kind != "default":
        raise ConfigError(f"unsupported rope_scaling {kind!r}; only unscaled RoPE is implemented")
    return rope


def _parse_qwen3(d: dict[str, Any], moe: bool) -> ModelConfig:
    rope = _rope(d)
    if d.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    layers = d["num_hidden_layers"]
    spec = None
    if moe:
        # As transformers' Qwen3MoeDecoderLayer picks them.
        dense, step = set(d.get("mlp_only_layers") or ()), d.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"decoder_sparse_step ({step!r}) must be a positive integer")
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        spec = _qwen_moe(d, sparse, shared=False) if sparse else None
    return ModelConfig(
        architecture="qwen3",
        layer_kinds=("attention",) * layers,
        norm_eps=d.get("rms_norm_eps", 1e-6),
        mlp_bias=False,
        use_bias=False,
        rope_theta=float(theta),
        mamba=None,
        moe=spec,
        **_common(d, dense_mlp=spec is None or len(spec.layers) < layers),
    )


def _parse_qwen3_5(d: dict[str, Any], moe: bool) -> ModelConfig:
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
    common = _common(d, dense_mlp=not moe)
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
        moe=_qwen_moe(d, tuple(range(layers)), shared=True) if moe else None,
        **common,
    )
