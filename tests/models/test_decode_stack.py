"""A model's decode step as one C++ call (models/decode_stack.py) is the layers' own forward
bit for bit, for Qwen3 (attention with q/k norm and rotation, SwiGLU) and NemotronH (Mamba2,
attention, relu^2), dense and with mixtures of experts (Qwen3-MoE's softmax routing;
NemotronH's grouped sigmoid routing, latent projections and shared expert): logits, and the
K/V and states it writes, step after step, with the projections on panel_linear (either
vector width) and on oneDNN (either side of the row limit), in a tight pool whose pages are
interleaved across requests. Steps and layers it does not take (a prefill chunk in the step,
Qwen3.5's linear attention and gated shared expert, the kernels off) run the layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu import ops as cpu_kernels
from kv.cache_buffers import allocate_caches
from kv.cache_layout import plan_layout
from models import decode_stack
from models.batch import SeqChunk, build_forward_batch
from models.layers import pack_linears, stack_projections
from models.loader import build_model
from models.model_files import load_config
from tests.kernels.cpu.vector_widths import VECTOR_BITS
from tests.models.hf_fixtures import save_hf_model

BLOCK = 4
PROMPTS = (9, 5, 13)
STEPS = 12
PAGES = 7  # attention pages a request: its prompt and every step's token fit


@pytest.fixture(scope="module", params=["qwen3", "nemotron_h", "qwen3_moe", "nemotron_h_moe"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, out)
    return out


def _model(path):
    cfg = load_config(path)
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norm weights away from one, so that each is seen
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        for name, b in model.named_buffers():  # NemotronH's routing bias, a buffer, counts too
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.6 - 0.3)
    stack_projections(model)
    pack_linears(model)
    return cfg, model


class CountingStack:
    """`decode_stack.decode`, counting the steps the fused stack ran."""

    def __init__(self, real):
        self.real, self.fused = real, 0

    def __call__(self, *args):
        out = self.real(*args)
        self.fused += out is not None
        return out


def _run(model, cfg):
    """Prefill three prompts, then STEPS decode steps of all three: each step's logits, and the
    cache buffers' bytes at the end."""
    groups = plan_layout(cfg, "float32", BLOCK, num_blocks=1).groups
    pool = 3 * sum(PAGES if g.kind == "attention" else 1 for g in groups)
    layout = plan_layout(cfg, "float32", BLOCK, num_blocks=pool)
    buffers, caches = allocate_caches(layout, cfg, "cpu")
    for buf in buffers:
        buf.zero_()  # every page is some request's: zeroed on allocation
    blocks: list[list[list[int]]] = [[] for _ in PROMPTS]
    first = 0
    for g in groups:
        n = PAGES if g.kind == "attention" else 1
        for r in range(len(PROMPTS)):  # request r's pages interleaved with the others'
            blocks[r].append([first + r + 3 * j for j in range(n)])
        first += 3 * n
    prompts = [list(range(3, 3 + n)) for n in PROMPTS]
    out = []
    with torch.inference_mode():
        chunks = [SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)]
        logits = model(build_forward_batch(chunks, groups, BLOCK, "cpu"), caches)
        lens = list(PROMPTS)
        for _ in range(STEPS):
            tokens = [int(t) for t in logits.argmax(-1)]
            step = [SeqChunk([t], n, b) for t, n, b in zip(tokens, lens, blocks)]
            logits = model(build_forward_batch(step, groups, BLOCK, "cpu"), caches)
            out.append(logits.clone())
            lens = [n + 1 for n in lens]
    return out, [b.clone() for b in buffers]


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
@pytest.mark.parametrize("panel_rows", [1, 8], ids=["onednn", "panel_linear"])
def test_fused_decode_is_the_layers_bit_for_bit(checkpoint, monkeypatch, panel_rows, vector_bits):
    choice = cpu_kernels.decide(True)
    assert choice.on, choice.why
    cfg, model = _model(checkpoint)
    _, plain = _model(checkpoint)  # the same weights, packed again
    with cpu_kernels.using(dataclasses.replace(choice, panel_rows=panel_rows, vector_bits=vector_bits)):
        counting = CountingStack(decode_stack.decode)
        monkeypatch.setattr(decode_stack, "decode", counting)
        fused_logits, fused_pages = _run(model, cfg)
        assert counting.fused == STEPS  # every decode step, and not the prefill
        monkeypatch.setattr(decode_stack, "decode", lambda *args: None)
        plain_logits, plain_pages = _run(plain, cfg)
    for a, b in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fused_pages, plain_pages, strict=True):
        assert torch.equal(a, b)  # the pages' bytes: K/V and Mamba states


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe_text"])
def test_no_stack_for_other_layers(kind, tmp_path):
    save_hf_model(kind, tmp_path)
    _, model = _model(tmp_path)
    with cpu_kernels.using(cpu_kernels.decide(True)):
        assert decode_stack.build(model) is None


def test_no_stack_without_the_kernels(checkpoint):
    _, model = _model(checkpoint)
    with cpu_kernels.using(cpu_kernels.decide(True)):
        assert decode_stack.build(model) is not None
    with cpu_kernels.using(cpu_kernels.decide(False)):
        assert decode_stack.build(model) is None
