"""The C++ CPU kernels against the torch path they replace on a CPU: the same outputs and state
updates on page-strided cache views, bf16 as well as fp32, prefill chunks as well as decode
tokens for the state kernels, and a clear error (not a read out of bounds) for a table, slot
or span that points outside what it indexes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import ops as cpu_kernels
from kv.cache_group import cdiv
from models.attention import _attend_decode
from models.batch import padding_indices
from models.layers import GatedRMSNorm, RMSNorm
from models.mamba import chunk_scan, ssm_step
from tests.kernels.cpu.vector_widths import VECTOR_BITS

BLOCK, KV_HEADS, HEADS, DIM, BLOCKS = 4, 2, 6, 16, 40


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load() is not None, "the CPU kernels did not build"


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's build lock outlives a build killed mid-way; the next engine must still start."""
    stale = cpu_kernels._build_dir() / "lock"
    stale.touch()
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from kernels.cpu import ops; assert ops.load() is not None"],
            cwd=Path(cpu_kernels.__file__).resolve().parents[2],  # the repository's root
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stale.unlink(missing_ok=True)
    assert loaded.returncode == 0, loaded.stderr


def _pages(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-major pages with room for other layers between them, as kv/cache_layout.py lays out."""
    buf = torch.randn(BLOCKS, 3, KV_HEADS, BLOCK, DIM).to(dtype)
    return buf[:, 0].transpose(1, 2), buf[:, 1].transpose(1, 2)


def _table(positions: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    used = [cdiv(p + 1, BLOCK) for p in positions]
    width = max(used)
    pages = torch.randperm(BLOCKS, generator=generator)
    rows, next_page = [], 0
    for u in used:
        rows.append([*pages[next_page : next_page + u].tolist(), *[0] * (width - u)])
        next_page += u
    valid = torch.arange(width)[None, :] < torch.tensor(used)[:, None]
    return torch.tensor(rows), (padding_indices(valid) if min(used) < width else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_paged_decode_attention_matches_the_torch_path(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    k_cache, v_cache = _pages(dtype)
    positions = torch.randint(0, 6 * BLOCK, (5,), generator=gen)
    positions[0] = BLOCK - 1  # a full last block
    table, padding = _table(positions.tolist(), gen)
    q = torch.randn(5, HEADS, DIM).to(dtype)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, positions, DIM**-0.5)
    want = _with_torch(q, k_cache, v_cache, table, padding, positions)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _with_torch(q, k_cache, v_cache, table, padding, positions) -> torch.Tensor:
    with cpu_kernels.using(cpu_kernels.decide(False)):
        return _attend_decode(q, k_cache, v_cache, table, padding, positions, None, DIM**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_indexed_assignment(dtype):
    k_cache, v_cache = _pages(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    blocks, offsets = torch.tensor([3, 3, 17, 0]), torch.tensor([0, 3, 2, 1])
    kv = torch.randn(4, 2 * KV_HEADS + 1, DIM).to(dtype)  # rows strided, as a split of qkv
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS : 2 * KV_HEADS]
    cpu_kernels.write_kv(k_cache, v_cache, k, v, blocks, offsets)
    want_k[blocks, offsets], want_v[blocks, offsets] = k, v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.write_kv(k_cache, v_cache, k[:1], v[:1], torch.tensor([0]), torch.tensor([BLOCK]))


def test_out_of_range_tables_are_refused():
    k_cache, v_cache = _pages(torch.float32)
    q = torch.randn(1, HEADS, DIM)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[BLOCKS]]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="outside its table"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0]]), torch.tensor([BLOCK]), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_decode_attention(q.double(), k_cache, v_cache, torch.tensor([[0]]), torch.tensor([0]), 1.0)


def _states(heads: int, pdim: int, nstate: int) -> torch.Tensor:
    """[blocks, H, P, N] fp32 views with a conv state before each, as a Mamba page holds them."""
    page = torch.randn(BLOCKS, 100 + heads * pdim * nstate)
    return page[:, 100:].view(BLOCKS, heads, pdim, nstate)


@pytest.mark.parametrize(("heads", "groups", "nstate"), [(4, 1, 16), (4, 2, 16), (6, 6, 16), (4, 2, 12)])
def test_mamba_ssm_decode_step_matches_the_torch_path(heads, groups, nstate):
    """One token per request (no spans); a state width that is not a multiple of the vector
    width takes the scalar loop."""
    torch.manual_seed(heads * 10 + groups)
    pdim, reqs, dt_min = 8, 5, 0.01
    kernel_cache = _states(heads, pdim, nstate)
    torch_cache = kernel_cache.clone()
    slots = torch.randperm(BLOCKS)[:reqs]
    x, dt = torch.randn(reqs, heads, pdim), torch.randn(reqs, heads) * 4
    dt[0, 0] = 30.0  # softplus's linear branch
    dt_bias, a, d = torch.randn(heads), -torch.rand(heads) * 3, torch.randn(heads)
    b, c = torch.randn(reqs, groups, nstate), torch.randn(reqs, groups, nstate)
    got = cpu_kernels.mamba_ssm(kernel_cache, slots, x, dt, (dt_bias, a, d, dt_min), b, c)
    step = torch.nn.functional.softplus(dt + dt_bias).clamp(min=dt_min)
    rep = heads // groups
    y = ssm_step(
        torch_cache,
        slots,
        torch.exp(step * a),
        step[..., None] * x,
        b.repeat_interleave(rep, 1),
        c.repeat_interleave(rep, 1),
    )
    torch.testing.assert_close(got, y + x * d[:, None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel_cache, torch_cache, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_decode_step_matches_the_torch_convolution(bias):
    torch.manual_seed(int(bias))
    channels, kernel, reqs = 12, 4, 3
    page = torch.randn(BLOCKS, 7 + channels * (kernel - 1))
    cache = page[:, 7:].view(BLOCKS, channels, kernel - 1)  # a conv state inside a Mamba page
    before = cache.clone()
    slots = torch.tensor([5, 0, BLOCKS - 1])
    x = torch.randn(reqs, 2 * channels)[:, :channels]  # rows strided, as a split of in_proj
    weight, b = torch.randn(channels, 1, kernel), (torch.randn(channels) if bias else None)
    got = cpu_kernels.causal_conv(cache, slots, x, weight, b)
    window = torch.cat([before[slots], x[..., None]], dim=-1)
    want = torch.nn.functional.conv1d(window, weight, b, groups=channels)[..., 0]
    torch.testing.assert_close(got, torch.nn.functional.silu(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache[slots], window[..., 1:])
    others = torch.ones(BLOCKS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(cache[others], before[others])


# Requests of a mixed step: (tokens, fresh). A fresh prompt longer than a chunk of the scan's
# token blocks, a continued chunk shorter than the convolution's window, decode tokens, and a
# fresh one-token prompt.
SPANS = [(11, True), (2, False), (1, False), (7, False), (1, True), (1, False)]


def _spans() -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([0, *torch.tensor([n for n, _ in SPANS]).cumsum(0).tolist()])
    return starts, torch.tensor([f for _, f in SPANS])


@pytest.mark.parametrize(("heads", "groups", "nstate"), [(4, 2, 16), (6, 3, 12)])
def test_mamba_ssm_scan_over_mixed_spans_matches_the_chunked_scan(heads, groups, nstate):
    """Each request's tokens in turn from its slot's state, or from zeros for a fresh one
    (whose slot holds NaN: it must not be read), against `chunk_scan` per request."""
    torch.manual_seed(heads + nstate)
    pdim, dt_min = 8, 0.01
    starts, fresh = _spans()
    tokens = int(starts[-1])
    cache = _states(heads, pdim, nstate)
    slots = torch.randperm(BLOCKS)[: len(SPANS)]
    cache[slots[fresh]] = float("nan")
    before = cache.clone()
    x, dt = torch.randn(tokens, heads, pdim), torch.randn(tokens, heads) * 2
    dt_bias, a, d = torch.randn(heads), -torch.rand(heads) * 3, torch.randn(heads)
    b, c = torch.randn(tokens, groups, nstate), torch.randn(tokens, groups, nstate)
    got = cpu_kernels.mamba_ssm(cache, slots, x, dt, (dt_bias, a, d, dt_min), b, c, (starts, fresh))
    step = torch.nn.functional.softplus(dt + dt_bias).clamp(min=dt_min)
    for r, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        init = None if fresh[r] else before[slots[r]][None]
        y, final = chunk_scan(x[None, lo:hi], step[None, lo:hi], a, b[None, lo:hi], c[None, lo:hi], d, 4, init)
        torch.testing.assert_close(got[lo:hi], y[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache[slots[r]], final[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_over_mixed_spans_matches_the_torch_convolution(bias):
    """Inputs before a request's first token come from its slot (zeros for a fresh request,
    whose slot holds NaN), and the slot keeps the last K - 1 inputs, some of them old state
    where the request has fewer new tokens than that."""
    torch.manual_seed(2 + int(bias))
    channels, kernel = 12, 4
    starts, fresh = _spans()
    tokens = int(starts[-1])
    page = torch.randn(BLOCKS, 7 + channels * (kernel - 1))
    cache = page[:, 7:].view(BLOCKS, channels, kernel - 1)
    slots = torch.randperm(BLOCKS)[: len(SPANS)]
    cache[slots[fresh]] = float("nan")
    before = cache.clone()
    x = torch.randn(tokens, 2 * channels)[:, :channels]
    weight, b = torch.randn(channels, 1, kernel), (torch.randn(channels) if bias else None)
    got = cpu_kernels.causal_conv(cache, slots, x, weight, b, (starts, fresh))
    for r, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        prev = torch.zeros(channels, kernel - 1) if fresh[r] else before[slots[r]]
        window = torch.cat([prev, x[lo:hi].T], dim=-1)
        want = torch.nn.functional.conv1d(window[None], weight, b, groups=channels)[0].T
        torch.testing.assert_close(got[lo:hi], torch.nn.functional.silu(want), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache[slots[r]], window[:, -(kernel - 1) :])


def test_spans_that_do_not_cover_the_tokens_are_refused():
    cache, conv = _states(2, 4, 8), torch.randn(BLOCKS, 6, 3)
    params = (torch.randn(2), torch.randn(2), torch.randn(2), 0.0)
    slots, fresh = torch.tensor([0, 1]), torch.tensor([True, False])
    x, dt, bc = torch.randn(3, 2, 4), torch.randn(3, 2), torch.randn(2, 3, 1, 8)
    for starts, why in [
        (torch.tensor([0, 1, 2]), "from 0 to the number of tokens"),
        (torch.tensor([0, 0, 3]), "must increase"),
        (torch.tensor([0, 3]), r"int64 \[requests \+ 1\]"),
    ]:
        with pytest.raises(RuntimeError, match=why):
            cpu_kernels.mamba_ssm(cache, slots, x, dt, params, *bc, (starts, fresh))
        with pytest.raises(RuntimeError, match=why):
            cpu_kernels.causal_conv(conv, slots, torch.randn(3, 6), torch.randn(6, 1, 4), None, (starts, fresh))
    with pytest.raises(RuntimeError, match="one token per request"):
        cpu_kernels.causal_conv(conv, slots, torch.randn(3, 6), torch.randn(6, 1, 4), None)


def test_mamba_slots_outside_the_cache_are_refused():
    cache = _states(2, 4, 8)
    params = (torch.randn(2), torch.randn(2), torch.randn(2), 0.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.mamba_ssm(
            cache, torch.tensor([BLOCKS]), torch.randn(1, 2, 4), torch.randn(1, 2), params, *torch.randn(2, 1, 1, 8)
        )
    conv = torch.randn(BLOCKS, 6, 3)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.causal_conv(conv, torch.tensor([-1]), torch.randn(1, 6), torch.randn(6, 1, 4), None)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 48),
        lambda: torch.randn(3, 7, 16),
        lambda: torch.randn(4, 10, 16)[:, 2:8],  # a strided slice, as of a stacked projection
        lambda: torch.randn(2, 3, 4, 16),  # more leading dims than the kernel walks
    ],
)
def test_rms_norm_matches_torch(make, weighted):
    x = make()
    weight = torch.randn(x.shape[-1]) if weighted else None
    want = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, 1e-6)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-6), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("dim", "group"), [(24, 24), (24, 8), (40, 5)])
def test_gated_rms_norm_matches_the_torch_path(dim, group):
    """x * silu(gate), normalised per group and weighted: the kernel against the module's torch
    path, with the gate a strided slice of a wider projection as in Mamba2."""
    torch.manual_seed(dim + group)
    norm = GatedRMSNorm(dim, group, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x, gate = torch.randn(7, dim), torch.randn(7, 3 * dim)[:, dim : 2 * dim]
    with torch.no_grad():
        got = norm(x, gate)
        with cpu_kernels.using(cpu_kernels.decide(False)):
            want = norm(x, gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_norms_that_need_a_gradient_keep_the_torch_op():
    """The kernels have no backward: training (training/train_tiny.py) must still get gradients."""
    norm = RMSNorm(16, 1e-6, weight_in_fp32=False)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(norm(x), cpu_kernels.rms_norm(x, norm.weight, 1e-6))


def _as_panels(weight: torch.Tensor, nb: int, kp: int) -> torch.Tensor:
    """`weight` [out, in] in the panel layout `panel_linear` reads, padding filled with NaN (a
    padded slot the kernel read would poison its row)."""
    out_features, in_features = weight.shape
    blocks = cdiv(out_features, nb)
    panels = torch.full((blocks * nb, kp), float("nan"))
    panels[:out_features, :in_features] = weight
    return panels.view(blocks, nb, kp).permute(0, 2, 1).contiguous()


@pytest.mark.parametrize("bits", VECTOR_BITS)
@pytest.mark.parametrize("nb", [16, 32, 48, 64])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 16])
def test_panel_linear_matches_the_plain_matmul(bits, nb, rows):
    """Both vector widths, every block width and so every column slice of the 256-bit groups
    (whole blocks of 16 and 32, halves of 48 and 64), row groups of one to six at 512 bits and
    one to three after the streaming row at 256 (seven, thirteen and sixteen rows split
    unevenly), output features that leave the last block part-filled, and a k that is not a
    multiple of the chunk or the padding."""
    torch.manual_seed(nb * 100 + rows)
    weight, bias = torch.randn(150, 131), torch.randn(150)
    panels = _as_panels(weight, nb, kp=144)
    x = torch.randn(rows, 131)
    for b in (bias, None):
        got = cpu_kernels.panel_linear(x, panels, b, 150, bits)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", VECTOR_BITS)
def test_panel_linear_shares_a_large_weights_blocks_among_threads(bits):
    """A weight of 256 KB blocks (k 1024, 64 columns) takes a thread each from the shared counter
    up to torch's thread count: every block computed once, whichever thread took it."""
    torch.manual_seed(7)
    weight, bias = torch.randn(4000, 1000), torch.randn(4000)
    panels = _as_panels(weight, 64, kp=1024)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for rows in (1, 5):
                x = torch.randn(rows, 1000)
                got = cpu_kernels.panel_linear(x, panels, bias, 4000, bits)
                torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-3)
    finally:
        torch.set_num_threads(threads)


def test_panel_linear_reads_strided_and_batched_rows():
    weight = torch.randn(40, 32)
    x = torch.randn(2, 2, 64)[..., ::2]  # [2, 2, 32], not contiguous
    got = cpu_kernels.panel_linear(x, _as_panels(weight, 16, 32), None, 40)
    assert got.shape == (2, 2, 40)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("panels", "features", "out_features", "match"),
    [
        (torch.zeros(2, 16, 24), 16, 48, "16, 32, 48 or 64 columns"),
        (torch.zeros(2, 16, 16), 20, 32, "20 features"),
        (torch.zeros(2, 16, 16), 16, 33, "do not fill"),
        (torch.zeros(2, 16, 16), 16, 16, "do not fill"),
        (torch.zeros(2, 16, 32)[..., ::2], 16, 32, "contiguous"),
        (torch.zeros(2, 16, 16), 16, 32, "128-bit vectors"),
    ],
)
def test_panel_linear_refuses_panels_that_do_not_hold_the_weight(panels, features, out_features, match):
    bits = 128 if "128" in match else 0
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels.panel_linear(torch.zeros(1, features), panels, None, out_features, bits)
