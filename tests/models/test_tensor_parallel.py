"""Tensor parallelism: two gloo ranks compute the logits one process computes.

Each case saves a random transformers checkpoint, runs it whole in this process, then in
two spawned processes that each load their shard and all-reduce over gloo on 127.0.0.1.
Cases with one KV head (and one Gated DeltaNet key head, one Mamba group) make the ranks
replicate what they cannot split; MoE cases split every expert's width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.ports import free_port
from kv.cache_buffers import allocate_caches
from kv.cache_layout import plan_layout
from models.batch import SeqChunk, build_forward_batch
from models.loader import load_model
from models.model_files import ModelLoadError
from models.reference import greedy_generate
from models.tensor_parallel import TPGroup, init_tp_group
from tests.models.hf_fixtures import save_hf_model
from tests.models.test_models import _fixed_blocks

torch.manual_seed(1)
PROMPTS = [torch.randint(2, 90, (n,)).tolist() for n in (21, 5, 13)]
TP = 2

CASES = {
    "nemotron_h": ("nemotron_h", {}),
    "nemotron_h-1kv-1group": ("nemotron_h", {"num_key_value_heads": 1, "n_groups": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3-1kv": ("qwen3", {"num_key_value_heads": 1}),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5-1kv": ("qwen3_5", {"num_key_value_heads": 1, "linear_num_key_heads": 1}),
    # Each expert's (and the shared expert's) intermediate width split over the ranks.
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "nemotron_h_moe": ("nemotron_h_moe", {}),
}


@torch.inference_mode()
def _outputs(model: torch.nn.Module) -> dict[str, Any]:
    """Paged prefill logits, dense logits, and greedy continuations with chunked prefill."""
    cfg = model.config
    layout = plan_layout(cfg, "float32", 4, num_blocks=64)
    _, caches = allocate_caches(layout, cfg, "cpu")
    blocks = _fixed_blocks(layout, len(PROMPTS), 8)
    chunks = [SeqChunk(p, 0, ids) for p, ids in zip(PROMPTS, blocks)]
    return {
        "paged": model(build_forward_batch(chunks, layout.groups, 4, "cpu"), caches),
        "dense": model.forward_dense(torch.tensor([PROMPTS[0]])),
        "greedy": greedy_generate(model, PROMPTS, 10, None, block_size=4, prefill_chunk=6),
        "kv_heads": cfg.num_key_value_heads,
    }


def _rank_main(rank: int, path: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(rank, TP, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    try:
        model = load_model(path, dtype=torch.float32, tp=tp).model
        torch.save(_outputs(model), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(case, tmp_path):
    kind, overrides = CASES[case]
    save_hf_model(kind, tmp_path, **overrides)
    want = _outputs(load_model(tmp_path, dtype=torch.float32).model)
    mp.spawn(_rank_main, args=(str(tmp_path), free_port(), str(tmp_path)), nprocs=TP, join=True)
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (got["paged"] - want["paged"]).abs().max().item() < 1e-4
        assert (got["dense"] - want["dense"]).abs().max().item() < 1e-4
        assert got["greedy"] == want["greedy"]
        # Split KV heads halve; a single KV head is replicated on both ranks.
        assert got["kv_heads"] == max(1, want["kv_heads"] // TP)


def test_unsplittable_heads_are_a_clear_error(tmp_path):
    save_hf_model("qwen3", tmp_path, num_attention_heads=3, num_key_value_heads=3, head_dim=16)
    with pytest.raises(ModelLoadError, match="3 heads do not split over tensor parallel size 2"):
        load_model(tmp_path, tp=TPGroup(0, 2))
