"""A dense Qwen3's decode step as one C++ call (models/dense_decode.py) is the layers' own
forward bit for bit: logits and the K/V it writes, step after step, with the projections on
panel_linear and on oneDNN (either side of the row limit), in a tight pool whose pages are
shared out across requests. Steps it does not take (a prefill chunk in the step, a mixture of
experts, the kernels off) run the layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu import ops as cpu_kernels
from kv.cache_buffers import allocate_caches
from kv.cache_layout import plan_layout
from models import dense_decode
from models.batch import SeqChunk, build_forward_batch
from models.layers import pack_linears, stack_projections
from models.loader import build_model
from models.model_files import load_config
from tests.models.hf_fixtures import save_hf_model

BLOCK = 4
POOL = 24  # blocks: three requests of up to 32 tokens fill it


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3")
    save_hf_model("qwen3", out)
    return out


def _model(path):
    cfg = load_config(path)
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norm weights away from one, so that each is seen
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    stack_projections(model)
    pack_linears(model)
    return cfg, model


class _Counting:
    """`dense_decode.decode`, counting the steps the fused stack ran."""

    def __init__(self, real):
        self.real, self.fused = real, 0

    def __call__(self, *args):
        out = self.real(*args)
        self.fused += out is not None
        return out


def _run(model, cfg, steps):
    """Prefill three prompts, then `steps` decode steps of all three; per step the logits, and
    the caches at the end."""
    layout = plan_layout(cfg, "float32", BLOCK, num_blocks=POOL)
    buffers, caches = allocate_caches(layout, cfg, "cpu")
    for buf in buffers:
        buf.zero_()  # every page is some request's: zeroed on allocation
    prompts = [list(range(3, 3 + n)) for n in (9, 5, 13)]
    # Pages interleaved across the requests, so a wrong table entry reads another's K/V.
    blocks = [[list(range(r, POOL, 3))] for r in range(3)]
    out = []
    with torch.inference_mode():
        logits = model(
            build_forward_batch([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], layout.groups, BLOCK, "cpu"),
            caches,
        )
        lens = [len(p) for p in prompts]
        for _ in range(steps):
            tokens = [int(t) for t in logits.argmax(-1)]
            step = [SeqChunk([t], n, b) for t, n, b in zip(tokens, lens, blocks)]
            logits = model(build_forward_batch(step, layout.groups, BLOCK, "cpu"), caches)
            out.append(logits.clone())
            lens = [n + 1 for n in lens]
    return out, [b.clone() for b in buffers]


@pytest.mark.parametrize("panel_rows", [1, 8], ids=["onednn", "panel_linear"])
def test_fused_decode_is_the_layers_bit_for_bit(qwen3_path, monkeypatch, panel_rows):
    choice = cpu_kernels.decide(True)
    assert choice.on, choice.why
    cfg, model = _model(qwen3_path)
    _, plain = _model(qwen3_path)  # the same weights, packed again
    with cpu_kernels.using(dataclasses.replace(choice, panel_rows=panel_rows)):
        counting = _Counting(dense_decode.decode)
        monkeypatch.setattr(dense_decode, "decode", counting)
        fused_logits, fused_pages = _run(model, cfg, steps=12)
        assert counting.fused == 12  # every decode step, and not the prefill
        monkeypatch.setattr(dense_decode, "decode", lambda *args: None)
        plain_logits, plain_pages = _run(plain, cfg, steps=12)
    for a, b in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fused_pages, plain_pages, strict=True):
        assert torch.equal(a, b)  # the pages' bytes


def test_no_fused_stack_without_the_kernels_or_for_experts(qwen3_path, tmp_path):
    _, model = _model(qwen3_path)
    with cpu_kernels.using(cpu_kernels.decide(False)):
        assert dense_decode.build_stack(model) is None
    moe = tmp_path / "moe"
    save_hf_model("qwen3_moe", moe)
    _, experts = _model(moe)
    with cpu_kernels.using(cpu_kernels.decide(True)):
        assert dense_decode.build_stack(model) is not None
        assert dense_decode.build_stack(experts) is None
