"""The two random-weight checkpoints `bench.peers` serves with both raypd and vLLM: a
NemotronH-style hybrid (Mamba2 + attention + MLP, ~20M parameters) and a dense Qwen3
(~30M), fp32, written by transformers with `save_pretrained` so both engines load the very
same directory. Attention heads are 64 wide: vLLM's CPU attention refuses narrower ones
such as the shipped model's.

A word-level tokenizer over the whole vocabulary comes with them, so that every token
decodes to non-empty text and a streaming client sees one chunk per token from either server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 4096
EOS = VOCAB - 1

_COMMON = dict(
    vocab_size=VOCAB,
    eos_token_id=EOS,
    bos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def _write_tokenizer(out: Path) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": f"w{EOS}",
                "pad_token": "w0",
                "unk_token": "w0",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


def _hybrid() -> torch.nn.Module:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        hidden_size=512,
        hybrid_override_pattern="M-M*-M-M*-",
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        mamba_num_heads=16,
        mamba_head_dim=64,
        ssm_state_size=64,
        n_groups=1,
        conv_kernel=4,
        chunk_size=128,
        expand=2,
        **_COMMON,
    )
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():  # spread decay rates so the Mamba state carries the whole prompt
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.A_log.uniform_(-2.0, 0.5)
                layer.mixer.dt_bias.uniform_(-2.0, 0.5)
    return model


def _dense() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        **_COMMON,
    )
    return Qwen3ForCausalLM(cfg)


BUILDERS = {"hybrid": _hybrid, "dense": _dense}


def make(kind: str, out: Path, seed: int = 0) -> int:
    """Write model `kind` to `out` (once: an existing checkpoint is kept); returns its parameter count."""
    if not (out / "config.json").is_file():
        torch.manual_seed(seed)
        model = BUILDERS[kind]().float().eval()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        _write_tokenizer(out)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
