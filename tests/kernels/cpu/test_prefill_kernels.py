"""The kernels a real-size prefill leans on, at real widths: Qwen3's fused q/k norm and rotation
against the torch ops it replaces (bit for bit, as the model's outputs must not move), with the
model's torch path where the kernels are off; the causal convolution over more channels
than one of its tasks takes (a real Mamba2's 6144), split across tasks by channel; and a fresh
prompt's causal attention against SDPA's, at both vector widths, with the NaN property of
docs/design.md §1 and the shapes it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops as cpu_kernels
from models.config import ModelConfig
from models.layers import Rotary
from models.qwen3 import Qwen3Attention
from tests.kernels.cpu.vector_widths import VECTOR_BITS


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


def _attention_inputs(tokens: int, slots: int, heads: int, kv_heads: int, dim: int):
    """q as the model hands it over: a view into each token's qkv row (heads contiguous, rows
    strided); k, v as gathered pages."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k, v = torch.randn(slots, kv_heads, dim, generator=gen), torch.randn(slots, kv_heads, dim, generator=gen)
    return q, k, v


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA's top-left causal pattern over every slot: query i sees slots 0..i."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
@pytest.mark.parametrize(
    ("tokens", "slots", "heads", "kv_heads", "dim"),
    [
        (1, 16, 16, 8, 128),  # one token, the rest of its page unused
        (37, 48, 16, 8, 128),  # Qwen3-0.6B's heads, a partial query block and key block
        (100, 112, 32, 8, 64),  # four query heads a KV head, heads of 64
        (130, 144, 8, 8, 64),  # one query head a KV head
        (300, 304, 16, 2, 128),  # eight a KV head, ten query blocks
    ],
)
def test_prefill_attention_equals_causal_sdpa(vector_bits, tokens, slots, heads, kv_heads, dim):
    q, k, v = _attention_inputs(tokens, slots, heads, kv_heads, dim)
    got = cpu_kernels.prefill_attention(q, k, v, dim**-0.5, vector_bits)
    torch.testing.assert_close(got, _causal_sdpa(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
def test_prefill_attention_a_nan_past_the_prompt_reaches_the_last_block(vector_bits):
    """A NaN value in a slot past the prompt (its last page's unused end) enters the last query
    block's sums with weight 0, as through SDPA's tile over it: skipping zero-on-allocate stays
    visible in the prompt's last token. A NaN key there is never scored (SDPA masks its score)."""
    q, k, v = _attention_inputs(70, 80, 16, 8, 128)
    v[75, 3] = float("nan")
    out = cpu_kernels.prefill_attention(q, k, v, 128**-0.5, vector_bits)
    poisoned = torch.zeros(out.shape[:2], dtype=torch.bool)
    poisoned[64:, 6:8] = True  # the last block of 32 queries, the query heads of KV head 3
    assert out[poisoned].isnan().all()
    assert out[~poisoned].isfinite().all()
    q, k, v = _attention_inputs(70, 80, 16, 8, 128)
    k[75] = float("nan")
    assert cpu_kernels.prefill_attention(q, k, v, 128**-0.5, vector_bits).isfinite().all()


@pytest.mark.parametrize(
    ("shapes", "error"),
    [
        (((9, 16, 128), (8, 8, 128)), "fewer slots"),
        (((9, 12, 128), (16, 8, 128)), "do not share"),
        (((9, 16, 48), (16, 8, 48)), "not a whole number of blocks"),
    ],
)
def test_prefill_attention_refuses_shapes_it_cannot_read(shapes, error):
    (tokens, heads, dim), kv_shape = shapes
    with pytest.raises(RuntimeError, match=error):
        cpu_kernels.prefill_attention(
            torch.randn(tokens, heads, dim), torch.randn(kv_shape), torch.randn(kv_shape), 1.0
        )
