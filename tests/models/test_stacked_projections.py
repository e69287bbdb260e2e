"""Stacking the projections that read one input (q, k and v; gate and up) into one matmul is
the same arithmetic: a stacked model's logits equal the separate projections', on the dense
path and on a paged step mixing prefill chunks and decode tokens. (Bit for bit on this machine;
the tolerance is a BLAS's: a matmul of another width may round its last bit differently.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kv.cache_buffers import allocate_caches
from kv.cache_group import cdiv
from kv.cache_layout import plan_layout
from models.batch import SeqChunk, build_forward_batch
from models.dtypes import dtype_name
from models.layers import Linear, StackedLinear, pack_linears, stack_projections
from models.loader import build_model
from models.model_files import load_config

BLOCK = 4


def _randomised(model: nn.Module) -> nn.Module:
    """Weights away from their initial values (norm weights start at one: stacking them would
    then be trivially right)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _paged_logits(model: nn.Module, cfg, dtype: torch.dtype) -> torch.Tensor:
    layout = plan_layout(cfg, dtype_name(dtype), BLOCK, num_blocks=64)
    buffers, caches = allocate_caches(layout, cfg, "cpu")
    for buf in buffers:
        buf.zero_()
    prompts = [list(range(3, 3 + n)) for n in (9, 14, 6)]
    blocks, next_id = [], 0
    for _ in prompts:
        ids = []
        for g in layout.groups:
            n = cdiv(20, BLOCK) if g.kind == "attention" else 1
            ids.append(list(range(next_id, next_id + n)))
            next_id += n
        blocks.append(ids)
    with torch.inference_mode():
        model(
            build_forward_batch([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], layout.groups, BLOCK, "cpu"),
            caches,
        )
        # Two requests decode one token while the third prefills its next chunk.
        step = [SeqChunk([7], 9, blocks[0]), SeqChunk([8, 9, 10], 14, blocks[1]), SeqChunk([11], 6, blocks[2])]
        return model(build_forward_batch(step, layout.groups, BLOCK, "cpu"), caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_projections_give_the_same_logits(hf_model, dtype):
    kind, path, _ = hf_model
    cfg = load_config(path)
    plain = _randomised(build_model(cfg)).to(dtype).eval()
    fused = copy.deepcopy(plain)
    stack_projections(fused)
    names = {name.rsplit(".", 1)[-1] for name, _ in fused.named_modules()}
    assert "qkv_proj" in names and "q_proj" not in names
    if not kind.startswith("nemotron_h"):  # NemotronH's MLPs and experts have no gate
        assert "gate_up_proj" in names and "gate_proj" not in names
    if kind.startswith("qwen3_5"):  # Gated DeltaNet's four input projections
        assert "in_proj" in names and "in_proj_qkv" not in names
    pack_linears(plain)
    pack_linears(fused)
    ids = torch.randint(2, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    with torch.inference_mode():
        torch.testing.assert_close(fused.forward_dense(ids), plain.forward_dense(ids), **tol)
    torch.testing.assert_close(_paged_logits(fused, cfg, dtype), _paged_logits(plain, cfg, dtype), **tol)


def test_stacked_linear_stacks_weights_and_biases_by_rows():
    parts = [Linear(6, n, bias=True) for n in (4, 2, 3)]
    out = StackedLinear(parts)
    x = torch.randn(5, 6)
    with torch.no_grad():
        torch.testing.assert_close(out(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-6, atol=1e-6)
        for got, part in zip(out.split(x), parts, strict=True):
            torch.testing.assert_close(got, part(x), rtol=1e-6, atol=1e-6)
    assert not out.weight.requires_grad
