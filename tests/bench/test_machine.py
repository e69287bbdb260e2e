"""bench.machine's pure parts: the CPU line benchmarks print first, and the arithmetic of the
TPOT and TTFT bounds from a checkpoint's tensor shapes (real checkpoints, written by
transformers, for the shape reading)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.machine import (
    FLAGS,
    ModelCost,
    active_expert_share,
    cost_from_tensors,
    cpu_flags,
    cpu_model_name,
    flags_line,
    model_cost,
)

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""


def test_cpu_model_name_and_flags_line():
    assert cpu_model_name(CPUINFO) == "AMD EPYC 9R14 96-Core Processor"
    assert cpu_model_name("processor\t: 0\n") == "unknown CPU"
    line = flags_line("AMD EPYC", 2, frozenset({"avx2", "fma", "sse2"}))
    assert line.startswith("cpu: AMD EPYC, 2 cores; flags: +avx2 +fma -avx512f")
    assert "-amx_bf16" in line and "sse2" not in line
    assert cpu_flags(frozenset({"avx512f", "amx_tile"})) == {f: f in ("avx512f", "amx_tile") for f in FLAGS}


def test_bounds_of_a_dense_tied_model():
    # 2 layers of one 8x8 projection each, a tied 16x8 embedding: the LM head is the
    # embedding read whole, prompt tokens multiply the layers and attend causally.
    shapes = {
        "model.embed_tokens.weight": (16, 8),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.1.self_attn.q_proj.weight": (8, 8),
        "model.norm.weight": (8,),
    }
    cost = cost_from_tensors(
        shapes, 4, {"tie_word_embeddings": True, "vocab_size": 16, "num_attention_heads": 2, "head_dim": 4}, 1.0
    )
    assert cost == ModelCost(
        weight_bytes_per_token=(128 + 128 + 8) * 4,
        matmul_params=128,
        lm_head_params=128,
        attention_layers=2,
        attention_width=8,
    )
    assert cost.tpot_bound_s(1056.0) == pytest.approx(1.0)
    # 3 tokens: 2*128*3 matmul + 2*128 LM head + 2*2 layers*8 width*3*4 attention
    assert cost.prompt_flops(3) == 2 * 128 * 3 + 2 * 128 + 2 * 2 * 8 * 3 * 4
    assert cost.ttft_bound_s(3, 100.0) == pytest.approx(cost.prompt_flops(3) / 100.0)


def test_untied_model_reads_one_embedding_row_and_the_active_experts_only():
    shapes = {
        "backbone.embeddings.weight": (16, 8),
        "lm_head.weight": (16, 8),
        "model.layers.0.mixer.experts.up_proj": (4, 2, 8),
        "model.layers.0.mixer.shared_experts.up_proj.weight": (2, 8),
    }
    config = {
        "vocab_size": 16,
        "num_attention_heads": 1,
        "head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 1,
    }
    assert active_expert_share(config) == 0.25
    assert active_expert_share({"num_experts": 8, "num_experts_per_tok": 2}) == 0.25
    assert active_expert_share({"vocab_size": 16}) == 1.0
    cost = cost_from_tensors(shapes, 2, config, active_expert_share(config))
    assert cost.weight_bytes_per_token == (16 + 16 + 128 + 8) * 2  # shared, active expert, LM head, one row
    assert cost.matmul_params == 32 and cost.lm_head_params == 128 and cost.attention_layers == 0


def test_model_cost_reads_a_transformers_checkpoint(tmp_path: Path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    total = sum(p.numel() for p in model.parameters())
    cost = model_cost(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    assert cost.weight_bytes_per_token == total * 4  # tied: the embedding is read whole, as the LM head
    assert cost.lm_head_params == 100 * 32
    assert cost.attention_layers == 2 and cost.attention_width == 32
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64  # q, k and v, o, gate/up/down
    assert cost.matmul_params == 2 * per_layer
