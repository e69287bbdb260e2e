"""The random-weight checkpoints `bench.peers` and `bench.peers_real` serve with both raypd
and vLLM, fp32, written by transformers with `save_pretrained` so both engines load the very
same directory:

- bench size (`make`): a NemotronH-style hybrid (Mamba2 + attention + MLP, ~20M parameters)
  and a dense Qwen3 (~30M). Attention heads are 64 wide: vLLM's CPU attention refuses
  narrower ones such as the shipped model's.
- real size (`make_real`): Qwen3-0.6B's shape (596M, tied embeddings), a ~0.5B NemotronH-style
  hybrid with Nemotron-H's Mamba2 head, state and group sizes, and a ~0.5B NemotronH with
  mixture-of-experts (`E`) layers, 6 of 48 experts active per token. Users run models of this
  size; the bench models fit in cache and hide what memory bandwidth costs.

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


def _write_tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": f"w{vocab_size - 1}",
                "pad_token": "w0",
                "unk_token": "w0",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


def _spread_decay(model: torch.nn.Module) -> torch.nn.Module:
    """Spread the Mamba2 decay rates so the state carries the whole prompt."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.A_log.uniform_(-2.0, 0.5)
                layer.mixer.dt_bias.uniform_(-2.0, 0.5)
    return model


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
    return _spread_decay(NemotronHForCausalLM(cfg))


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

REAL_VOCAB = {"dense": 151936, "hybrid": 131072, "moe": 131072}


def _real_common(kind: str) -> dict[str, object]:
    vocab = REAL_VOCAB[kind]
    return dict(vocab_size=vocab, eos_token_id=vocab - 1, bos_token_id=1, pad_token_id=0, max_position_embeddings=4096)


def _real_nemotron_h(pattern: str, **moe: int) -> torch.nn.Module:
    """Nemotron-H's block sizes at hidden 1024: 32 Mamba2 heads of 64 (state 128, 8 groups),
    attention heads of 128 (vLLM's CPU attention needs 64 or more), untied embeddings."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        hidden_size=1024,
        hybrid_override_pattern=pattern,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=4096,
        mamba_num_heads=32,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        chunk_size=128,
        expand=2,
        tie_word_embeddings=False,
        **moe,
        **_real_common("moe" if moe else "hybrid"),
    )
    return _spread_decay(NemotronHForCausalLM(cfg))


def _real_dense() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        **_real_common("dense"),
    )
    return Qwen3ForCausalLM(cfg)


# vLLM 0.32's CPU MoE refuses experts without a gated activation (NemotronH's are relu2):
# `is_act_and_mul=False is supported only for CUDA, XPU and ROCm`. Its Qwen3.5(-MoE) module
# imports torchvision, which `make .venv-vllm` uninstalls (the one pip brings breaks
# `import vllm`). So the MoE hybrid is raypd's alone: bench.peers_real reports its figures.
VLLM_REFUSES = {"moe": "vLLM 0.32 CPU has no MoE without a gated activation (NemotronH's experts are relu2)"}

REAL_BUILDERS = {
    "dense": _real_dense,
    "hybrid": lambda: _real_nemotron_h("M-M-M*-M-M-M*-M-M-M*-M-M-M-"),
    "moe": lambda: _real_nemotron_h(
        "MEMEM*EMEMEM*E",
        n_routed_experts=48,
        num_experts_per_tok=6,
        moe_intermediate_size=256,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=1024,
    ),
}


def _write(model: torch.nn.Module, out: Path, vocab_size: int) -> None:
    """Write into a sibling directory, then rename it into place: a checkpoint of gigabytes
    takes a while, and an interrupted write must not pass for a finished one next time."""
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    _write_tokenizer(tmp, vocab_size)
    tmp.rename(out)


def param_count(out: Path) -> int:
    """Parameters stored in the checkpoint at `out` (every safetensors shard)."""
    from safetensors import safe_open

    total = 0
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
    return total


def make(kind: str, out: Path, seed: int = 0) -> int:
    """Write model `kind` to `out` (once: an existing checkpoint is kept); returns its parameter count."""
    if not (out / "config.json").is_file():
        torch.manual_seed(seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(BUILDERS[kind]().float().eval(), out, VOCAB)
    return param_count(out)


def make_real(kind: str, out: Path, seed: int = 0) -> int:
    """Write real-size model `kind` (dense, hybrid, moe) to `out` once; returns its parameter count."""
    if not (out / "config.json").is_file():
        torch.manual_seed(seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(REAL_BUILDERS[kind]().float().eval(), out, REAL_VOCAB[kind])
    return param_count(out)
