"""Tiny random-weight checkpoints written by transformers, for checking our models against it."""

from __future__ import annotations

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
    within a few tokens)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                layer.linear_attn.A_log.uniform_(-3.0, 0.5)
                layer.linear_attn.dt_bias.uniform_(-2.0, 0.5)


def save_hf_model(kind: str, out: Path, seed: int = 0, **overrides):
    """Build a random transformers model of `kind` (config fields overridden by `overrides`),
    save it, and return it (fp32, eval)."""
    from transformers import NemotronHForCausalLM, Qwen3_5ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(qwen3_5_config(**overrides))
        spread_linear_attention_decay(model)
    elif kind == "nemotron_h":
        model = NemotronHForCausalLM(nemotron_h_config(**overrides))
        # Spread the Mamba decay rates and gates so the state matters over the whole prompt.
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    layer.mixer.A_log.uniform_(-2.0, 0.5)
                    layer.mixer.dt_bias.uniform_(-2.0, 0.5)
                    layer.mixer.D.normal_()
    else:
        model = Qwen3ForCausalLM(qwen3_config(**overrides))
    model.eval()
    model.save_pretrained(out)
    write_tokenizer(out)
    return model
