"""The kernels a real-size prefill leans on, at real widths: Qwen3's fused q/k norm and rotation
against the torch ops it replaces (bit for bit, as the model's outputs must not move), with the
model's torch path where the kernels are off; and the causal convolution over more channels
than one of its tasks takes (a real Mamba2's 6144), split across tasks by channel."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops as cpu_kernels
from models.config import ModelConfig
from models.layers import Rotary
from models.qwen3 import Qwen3Attention


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load() is not None, "the CPU kernels did not build"


def _torch_qk(qk: torch.Tensor, weight: torch.Tensor, rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
    """The composite the kernel replaces on a CPU: the weightless norm kernel, the stacked
    weight, the rotation."""
    normed = cpu_kernels.rms_norm(qk, None, 1e-6)
    return rotary(normed * weight, positions)


@pytest.mark.parametrize(("tokens", "head_dim"), [(1, 128), (5, 64), (128, 128)])
def test_qk_norm_rope_is_the_torch_ops_bit_for_bit(tokens, head_dim):
    torch.manual_seed(tokens + head_dim)
    heads, kv_heads = 16, 8
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim) * 3
    qk = qkv[:, : heads + kv_heads]  # a strided slice of the stacked projection, as in the model
    weight = torch.randn(heads + kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,))
    rotary = Rotary(head_dim, 1e6)
    cos, sin = rotary.table(positions, torch.float32)
    got = cpu_kernels.qk_norm_rope(qk, weight, cos, sin, 1e-6)
    assert got.is_contiguous()
    assert torch.equal(got, _torch_qk(qk, weight, rotary, positions))


def _qwen3_cfg() -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 512,
            "vocab_size": 128,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "max_position_embeddings": 512,
        }
    )


def test_qwen3_attention_gets_the_same_q_k_v_with_the_kernels_off():
    """The model's stacked path through the kernel and through torch (`--no-cpu-kernels`, a
    GPU), whose norm rounds its sum of squares its own way."""
    torch.manual_seed(0)
    attn = Qwen3Attention(_qwen3_cfg())
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p))
    attn.stack_projections()
    h, positions = torch.randn(9, 256), torch.arange(3, 12)
    with torch.no_grad():
        got = attn._qkv(h, positions)
        with cpu_kernels.using(cpu_kernels.decide(False)):
            want = attn._qkv(h, positions)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_qk_norm_rope_refuses_mismatched_tables():
    qk, weight = torch.randn(3, 4, 64), torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_kernels.qk_norm_rope(qk, weight, torch.randn(2, 64), torch.randn(2, 64), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.qk_norm_rope(qk, torch.randn(3, 64), torch.randn(3, 64), torch.randn(3, 64), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        cpu_kernels.qk_norm_rope(
            torch.randn(3, 4, 63), torch.randn(4, 63), torch.randn(3, 63), torch.randn(3, 63), 1e-6
        )


@pytest.mark.parametrize("fresh", [True, False])
def test_causal_conv_over_many_channels_matches_the_torch_convolution(fresh):
    """A prefill chunk of one request over 1300 channels (three tasks, the last partial),
    continuing a state or from zeros (the slot then holds NaN, never read)."""
    torch.manual_seed(int(fresh))
    channels, kernel, tokens, blocks = 1300, 4, 37, 6
    page = torch.randn(blocks, 5 + channels * (kernel - 1))
    cache = page[:, 5:].view(blocks, channels, kernel - 1)  # a conv state inside a Mamba page
    slot = torch.tensor([3])
    if fresh:
        cache[3] = float("nan")
    before = cache.clone()
    x = torch.randn(tokens, 2 * channels)[:, :channels]  # rows strided, as a split of in_proj
    weight, bias = torch.randn(channels, 1, kernel), torch.randn(channels)
    spans = (torch.tensor([0, tokens]), torch.tensor([fresh]))
    got = cpu_kernels.causal_conv(cache, slot, x, weight, bias, spans)
    prev = torch.zeros(channels, kernel - 1) if fresh else before[3]
    window = torch.cat([prev, x.T], dim=-1)
    want = torch.nn.functional.conv1d(window[None], weight, bias, groups=channels)[0].T
    torch.testing.assert_close(got, torch.nn.functional.silu(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[3], window[:, -(kernel - 1) :])
    others = torch.ones(blocks, dtype=torch.bool)
    others[3] = False
    assert torch.equal(cache[others], before[others])
