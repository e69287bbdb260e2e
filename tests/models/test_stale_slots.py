"""Why zero-on-allocate exists: attention reads whole blocks, so a NaN in an unused slot of
an allocated block poisons the output unless the block was zeroed first."""

from __future__ import annotations

import torch

from kv.cache_buffers import allocate_caches
from kv.cache_group import cdiv
from kv.cache_layout import plan_layout
from models.batch import SeqChunk, build_forward_batch
from models.loader import load_model

BLOCK = 4


def _run(model, prompt, poison: bool, zero_after_poison: bool) -> torch.Tensor:
    cfg = model.config
    layout = plan_layout(cfg, "float32", BLOCK, num_blocks=32)
    buffers, caches = allocate_caches(layout, cfg, "cpu")
    for buf in buffers:
        buf.zero_()
    n_blocks = cdiv(len(prompt), BLOCK) + 1
    ids = [list(range(0, n_blocks)) if g.kind == "attention" else [16 + i] for i, g in enumerate(layout.groups)]
    last = ids[0][(len(prompt) - 1) // BLOCK]
    if poison:
        for layer in layout.groups[0].layer_ids:
            caches[layer][1][last, BLOCK - 1] = float("nan")  # V of the block's last, unused slot
        if zero_after_poison:
            for buf in buffers:
                buf[last] = 0
    with torch.no_grad():
        return model(build_forward_batch([SeqChunk(prompt, 0, ids)], layout.groups, BLOCK, "cpu"), caches)


def test_nan_in_unused_slot_poisons_unless_zeroed(hf_model):
    _, path, _ = hf_model
    model = load_model(path, dtype=torch.float32).model
    prompt = list(range(2, 2 + 4 * BLOCK + 2))  # the last block is half used
    clean = _run(model, prompt, poison=False, zero_after_poison=False)
    poisoned = _run(model, prompt, poison=True, zero_after_poison=False)
    zeroed = _run(model, prompt, poison=True, zero_after_poison=True)
    assert torch.isfinite(clean).all()
    assert not torch.isfinite(poisoned).all()
    assert torch.equal(zeroed, clean)
