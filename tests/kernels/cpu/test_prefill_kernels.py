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


PAGE = 16


def _paged_step(step: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int = 0):
    """A step of one chunk a request, (tokens cached before, tokens now) each, as the model hands
    it to the kernel: q a view into each token's qkv row (heads contiguous, rows strided); the
    caches head-major pages (kv/cache_buffers.py's layout), each request's pages interleaved with
    the others' and page 0 nobody's; table rows padded with 0; chunks (first row, rows, position)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(done + n) // PAGE) for done, n in step]
    order = torch.randperm(sum(pages), generator=gen) + 1
    ids, at = [], 0
    for n in pages:
        ids.append(order[at : at + n].tolist())
        at += n
    kv = torch.randn(sum(pages) + 1, 2, kv_heads, PAGE, dim, generator=gen)
    k_cache, v_cache = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    tokens = sum(n for _, n in step)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    table = torch.tensor([row + [0] * (max(pages) - len(row)) for row in ids], dtype=torch.long)
    starts = [0]
    for _, n in step:
        starts.append(starts[-1] + n)
    chunks = torch.tensor([(starts[r], n, done) for r, (done, n) in enumerate(step)], dtype=torch.long)
    return q, k_cache, v_cache, table, chunks, ids


def _run(q, k_cache, v_cache, table, chunks, vector_bits: int = 0) -> torch.Tensor:
    out = torch.full(q.shape, 7.0)
    cpu_kernels.prefill_attention(q, k_cache, v_cache, table, chunks, out, q.shape[-1] ** -0.5, vector_bits)
    return out


def _own_tokens(cache: torch.Tensor, ids: list[int], length: int) -> torch.Tensor:
    """[KVH, length, D]: a request's tokens read page by page."""
    return torch.cat([cache[b] for b in ids])[:length].transpose(0, 1)


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
@pytest.mark.parametrize(
    ("step", "heads", "kv_heads", "dim"),
    [
        ([(0, 1)], 16, 8, 128),  # one token, the rest of its page unused
        ([(0, 37)], 16, 8, 128),  # Qwen3-0.6B's heads, a partial query block and key block
        ([(0, 100)], 32, 8, 64),  # four query heads a KV head, heads of 64
        ([(0, 130)], 8, 8, 64),  # one query head a KV head
        ([(0, 300)], 16, 2, 128),  # eight a KV head, ten query blocks
        ([(200, 56)], 16, 8, 128),  # after 200 cached tokens: a prefill engine's later chunk
        ([(0, 40), (17, 70), (256, 5), (3, 2)], 16, 8, 128),  # fresh and resumed, side by side
    ],
)
def test_prefill_attention_equals_masked_sdpa_over_each_requests_own_tokens(vector_bits, step, heads, kv_heads, dim):
    q, k_cache, v_cache, table, chunks, ids = _paged_step(step, heads, kv_heads, dim)
    out = _run(q, k_cache, v_cache, table, chunks, vector_bits)
    start = 0
    for (done, n), pages in zip(step, ids):
        keys, values = _own_tokens(k_cache, pages, done + n), _own_tokens(v_cache, pages, done + n)
        visible = torch.arange(done + n)[None, :] <= torch.arange(done, done + n)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1), keys, values, attn_mask=visible, scale=dim**-0.5, enable_gqa=True
        )
        torch.testing.assert_close(out[start : start + n], want.transpose(0, 1), rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
def test_a_prompt_cut_into_chunks_gets_its_whole_rows_bit_for_bit(vector_bits):
    """Where a prefill engine's step budget cuts a prompt, each chunk's rows are the rows of the
    prompt computed whole: keys are taken in the same blocks from slot 0, and blocks past a
    query add exactly nothing. A prompt answers the same under any step budget."""
    q, k_cache, v_cache, table, _, _ = _paged_step([(0, 300)], 16, 8, 128)
    whole = _run(q, k_cache, v_cache, table, torch.tensor([(0, 300, 0)]), vector_bits)
    for cut in ((0, 100), (100, 156), (256, 44)):
        chunk = torch.tensor([(cut[0], cut[1], cut[0])])
        rows = slice(cut[0], sum(cut))
        assert torch.equal(_run(q, k_cache, v_cache, table, chunk, vector_bits)[rows], whole[rows])


def test_rows_outside_the_chunks_are_left_as_they_are():
    """A step's single-token rows are the decode kernel's: the chunks' call writes only its own."""
    q, k_cache, v_cache, table, _, _ = _paged_step([(5, 1), (0, 20)], 16, 8, 128)
    out = _run(q, k_cache, v_cache, table[1:], torch.tensor([(1, 20, 0)]))
    assert (out[0] == 7.0).all() and (out[1:] != 7.0).any(dim=-1).all()


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
def test_a_nan_past_the_chunk_reaches_its_last_block_and_other_pages_do_not(vector_bits):
    """A NaN value in a slot past the chunk (its last page's unused end) enters the last query
    block's sums with weight 0, as through SDPA's tile over it: skipping zero-on-allocate stays
    visible in the chunk's last token. A NaN key there is never scored (SDPA masks its score),
    and a page the request does not own (page 0, its table's padding) is never read."""
    step = [(30, 40), (0, 90)]  # request 0 reaches position 69, in its fifth page
    q, k_cache, v_cache, table, chunks, ids = _paged_step(step, 16, 8, 128)
    k_cache[0] = v_cache[0] = float("nan")
    v_cache[ids[0][4], 75 - 4 * PAGE, 3] = float("nan")
    out = _run(q, k_cache, v_cache, table, chunks, vector_bits)
    poisoned = torch.zeros(out.shape[:2], dtype=torch.bool)
    poisoned[32:40, 6:8] = True  # request 0's last block of queries, the query heads of KV head 3
    assert out[poisoned].isnan().all()
    assert out[~poisoned].isfinite().all()
    q, k_cache, v_cache, table, chunks, ids = _paged_step(step, 16, 8, 128)
    k_cache[ids[0][4], 75 - 4 * PAGE] = float("nan")
    assert _run(q, k_cache, v_cache, table, chunks, vector_bits).isfinite().all()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"table": torch.tensor([[1, 99]])}, "block 99 of request 0 is outside the cache"),
        ({"table": torch.tensor([[1]])}, "reaches position 19, outside its table"),
        ({"chunks": torch.tensor([(0, 21, 0)])}, r"rows 0..21, position 0\) is outside the step's 20 tokens"),
        ({"chunks": torch.tensor([(0, 20, 0), (0, 1, 0)])}, "a row for each row of the table"),
        ({"q": torch.randn(20, 12, 128)}, "do not share"),
        ({"out": torch.empty(20, 16, 64)}, "out must be"),
    ],
)
def test_prefill_attention_refuses_what_it_cannot_read(change, error):
    q, k_cache, v_cache, table, chunks, _ = _paged_step([(0, 20)], 16, 8, 128)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "table": table, "chunks": chunks} | change
    out = args.pop("out", torch.empty(args["q"].shape))
    with pytest.raises(RuntimeError, match=error):
        cpu_kernels.prefill_attention(**args, out=out, scale=1.0)


def test_prefill_attention_refuses_heads_of_no_whole_number_of_blocks():
    q, k_cache, v_cache, table, chunks, _ = _paged_step([(0, 9)], 16, 8, 48)
    with pytest.raises(RuntimeError, match="not a whole number of blocks"):
        _run(q, k_cache, v_cache, table, chunks, 256)
