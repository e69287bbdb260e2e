"""Tiny random-weight checkpoints written by transformers, for checking our models against it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 96


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer over VOCAB symbols: the loader insists on a tokenizer.json."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))


def nemotron_h_config(**overrides):
    from transformers import NemotronHConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        hybrid_override_pattern="M*-M*-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
        bos_token_id=1,
        initializer_range=0.2,
    )
    kw.update(overrides)
    return NemotronHConfig(**kw)


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
        bos_token_id=1,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def qwen3_5_config(**overrides):
    """Four layers in transformers' default pattern (three Gated DeltaNet, then full
    attention), two key heads serving four value heads, RoPE on a quarter of each head.
    No EOS: with this seed our greedy pick is sometimes the last token id, which
    `generate(min_new_tokens=...)` would mask out of transformers' argmax."""
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=1,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def spread_linear_attention_decay(model) -> None:
    """Decay rates and write strengths from slow to fast, so the Gated DeltaNet state
    carries information across the whole prompt (transformers' A in [0.01, 16] forgets
    within a few tokens). A multimodal model's are its language model's."""
    layers = getattr(model.model, "language_model", model.model).layers
    with torch.no_grad():
        for layer in layers:
            if layer.block_type == "linear_attention":
                layer.linear_attn.A_log.uniform_(-3.0, 0.5)
                layer.linear_attn.dt_bias.uniform_(-2.0, 0.5)


def _fields(config) -> dict:
    """A dense config's fields, for its MoE variant's config (not its model type: transformers
    picks the on-disk expert layout by that)."""
    kw = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        kw.pop(key, None)
    return kw


def qwen3_moe_config(**overrides):
    """Eight experts, two a token, the middle layer a dense MLP (`mlp_only_layers`)."""
    from transformers import Qwen3MoeConfig

    kw = _fields(qwen3_config())
    kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def qwen3_5_moe_config(**overrides):
    """The released layout: the text model (every MLP eight experts, two a token, and a gated
    shared expert) inside a multimodal config with a tiny vision tower."""
    from transformers import Qwen3_5MoeConfig

    text = _fields(qwen3_5_config())
    del text["intermediate_size"]
    text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    text.update(overrides)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"])
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def qwen3_5_multimodal_config(**overrides):
    """Dense Qwen3.5 as released: the text model inside a multimodal config."""
    from transformers import Qwen3_5Config

    text = _fields(qwen3_5_config(**overrides))
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"])
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


def qwen3_5_moe_text_config(**overrides):
    """Qwen3.5-MoE's text model alone (`Qwen3_5MoeForCausalLM`)."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**qwen3_5_moe_config(**overrides).text_config.to_dict())


def nemotron_h_moe_config(**overrides):
    """Mamba2, attention, MLP and MoE layers; the experts in a latent space, routed over two
    groups of four (one group chosen), renormalised and scaled."""
    kw = dict(
        hybrid_override_pattern="ME*EM-",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=32,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    kw.update(overrides)
    return nemotron_h_config(**kw)


# MoE kinds, as the released directories are: sharded safetensors with an index.
MOE_KINDS = ("qwen3_moe", "qwen3_5_moe", "nemotron_h_moe")
# The other released classes, also saved sharded.
RELEASED_KINDS = ("qwen3_5_multimodal", "qwen3_5_moe_text")
SHARD_SIZE = "200KB"


def _spread_routers(model) -> None:
    """Router weights wide enough that each token's picks are clear (transformers' init leaves
    near-ties that rounding could flip), and NemotronH's correction bias set, so it counts."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".gate") and hasattr(module, "top_k"):
                module.weight.normal_(0.0, 0.5)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.uniform_(-0.3, 0.3)


def _add_mtp_shard(out: Path, hidden: int) -> None:
    """A multi-token-prediction tensor beside the model, as released Qwen3.5 directories have."""
    from safetensors.torch import save_file

    save_file({"mtp.fc.weight": torch.randn(hidden, 2 * hidden)}, str(out / "mtp.safetensors"))
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors"
    index_path.write_text(json.dumps(index))


def save_hf_model(kind: str, out: Path, seed: int = 0, **overrides):
    """Build a random transformers model of `kind` (config fields overridden by `overrides`;
    a multimodal model's text config fields), save it (MoE kinds sharded), and return it
    (fp32, eval)."""
    from transformers import (
        NemotronHForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(qwen3_5_config(**overrides))
        spread_linear_attention_decay(model)
    elif kind == "qwen3_5_moe":
        model = Qwen3_5MoeForConditionalGeneration(qwen3_5_moe_config(**overrides))
        spread_linear_attention_decay(model)
    elif kind == "qwen3_5_multimodal":
        model = Qwen3_5ForConditionalGeneration(qwen3_5_multimodal_config(**overrides))
        spread_linear_attention_decay(model)
    elif kind == "qwen3_5_moe_text":
        model = Qwen3_5MoeForCausalLM(qwen3_5_moe_text_config(**overrides))
        spread_linear_attention_decay(model)
    elif kind in ("nemotron_h", "nemotron_h_moe"):
        cfg = nemotron_h_config(**overrides) if kind == "nemotron_h" else nemotron_h_moe_config(**overrides)
        model = NemotronHForCausalLM(cfg)
        # Spread the Mamba decay rates and gates so the state matters over the whole prompt.
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    layer.mixer.A_log.uniform_(-2.0, 0.5)
                    layer.mixer.dt_bias.uniform_(-2.0, 0.5)
                    layer.mixer.D.normal_()
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(qwen3_moe_config(**overrides))
    else:
        model = Qwen3ForCausalLM(qwen3_config(**overrides))
    _spread_routers(model)
    model.eval()
    if kind in MOE_KINDS or kind in RELEASED_KINDS:
        model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    else:
        model.save_pretrained(out)
    if kind == "qwen3_5_moe":
        _add_mtp_shard(out, model.config.text_config.hidden_size)
    write_tokenizer(out)
    return model
