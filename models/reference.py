"""In-process batched greedy generation over the paged cache.

The smallest driver of a model's flat-batch forward: it gives each request fixed blocks up
front, zeroes the attention pages (the memory starts uninitialised, as on a device), then
prefills (optionally in chunks) and decodes all requests together. The serving engine in
`actors/` does the same with real scheduling; this one is the reference it is checked
against and the `local` accuracy mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from kv.cache_buffers import allocate_caches
from kv.cache_layout import plan_layout
from kv.kv_cache_manager import KVCacheManager
from models.batch import SeqChunk, build_forward_batch
from models.config import ModelConfig
from models.dtypes import dtype_name


@torch.inference_mode()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    block_size: int = 16,
    zero_kv_after_prefill: bool = False,
    prefill_chunk: int | None = None,
) -> list[list[int]]:
    """Return each prompt's new tokens (EOS excluded). `zero_kv_after_prefill` wipes every
    attention K/V page after the prompt is in, which shows what the model owes to the KV
    a disaggregated deployment transfers."""
    cfg = cast(ModelConfig, model.config)
    weight = next(model.parameters())
    max_len = max(len(p) for p in prompts) + max_new_tokens
    layout = plan_layout(cfg, dtype_name(weight.dtype), block_size, num_blocks=1)
    blocks = KVCacheManager(layout.groups, 1, block_size, enable_prefix_caching=False)
    need = sum(m.num_required_blocks(max_len) for m in blocks.managers) * len(prompts)
    layout = plan_layout(cfg, dtype_name(weight.dtype), block_size, num_blocks=need)
    buffers, caches = allocate_caches(layout, cfg, weight.device)
    blocks = KVCacheManager(layout.groups, need, block_size, enable_prefix_caching=False)
    block_ids: list[list[list[int]]] = []
    for r in range(len(prompts)):
        blocks.allocate_slots(str(r), max_len)
        block_ids.append([list(ids) for ids in blocks.get_block_ids(str(r))])
    attn_ids = list(blocks.take_blocks_to_zero())

    def zero_attention() -> None:
        for buf in buffers:
            buf[attn_ids] = 0

    zero_attention()
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    computed = [0] * len(prompts)
    chunk = prefill_chunk or max_len
    while not all(c == len(p) for c, p in zip(computed, prompts)):
        live = [r for r, p in enumerate(prompts) if computed[r] < len(p)]
        chunks = [SeqChunk(prompts[r][computed[r] : computed[r] + chunk], computed[r], block_ids[r]) for r in live]
        logits = model(build_forward_batch(chunks, layout.groups, block_size, weight.device), caches)
        for r, c, row in zip(live, chunks, logits):
            computed[r] += len(c.token_ids)
            if computed[r] == len(prompts[r]):
                outputs[r].append(int(row.argmax()))
    if zero_kv_after_prefill:
        zero_attention()
    for r, out in enumerate(outputs):
        done[r] = max_new_tokens <= 1 or out[-1] == eos_token_id
    while not all(done):
        live = [r for r in range(len(prompts)) if not done[r]]
        chunks = [SeqChunk([outputs[r][-1]], len(prompts[r]) + len(outputs[r]) - 1, block_ids[r]) for r in live]
        logits = model(build_forward_batch(chunks, layout.groups, block_size, weight.device), caches)
        for r, row in zip(live, logits):
            outputs[r].append(int(row.argmax()))
            done[r] = len(outputs[r]) >= max_new_tokens or outputs[r][-1] == eos_token_id
    return [o[:-1] if o and o[-1] == eos_token_id else o for o in outputs]
