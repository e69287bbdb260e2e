"""`config.json` of each shipped tiny model, by architecture (`python -m training.train_tiny --arch`).

Both are hybrids sized so the associative-recall task (training.tiny_task) is learnt in
minutes on CPU: attention layers with GQA hold the prompt's KV that PD moves, state layers
(Mamba2, Gated DeltaNet) hold the per-request state it must not zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from training.build_tokenizer import EOS_TOKEN_ID, MODEL_MAX_LENGTH, PAD_TOKEN_ID, VOCAB_SIZE


def _tokens() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def nemotron_h() -> dict[str, Any]:
    """Two attention layers with GQA (the KV that PD moves) and two Mamba layers (the state it
    must not zero); the Mamba layers come first because NemotronH attention has no positional
    embedding and relies on them for order."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M*-M*-",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "mlp_hidden_act": "relu2",
        "ssm_state_size": 32,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "mamba_hidden_act": "silu",
        "n_groups": 1,
        "expand": 1,
        "conv_kernel": 4,
        "chunk_size": 64,
        "layer_norm_epsilon": 1e-5,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "attention_bias": False,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        **_tokens(),
    }


def qwen3_5() -> dict[str, Any]:
    """Qwen3.5's layer kinds at toy size: Gated DeltaNet then gated attention, twice, with
    grouped value heads (2 key heads serve 4 value heads) as the real model has, and RoPE on
    a quarter of each attention head. The MLP is narrow because every layer has one."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        **_tokens(),
    }


TINY_CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {"nemotron_h": nemotron_h, "qwen3_5": qwen3_5}
