"""Our Qwen3.5 hybrid against transformers' `Qwen3_5ForCausalLM` on tiny random configs.

tests/models/test_models.py runs the checks every architecture gets on the default tiny
config; these add the shapes Qwen3.5 has and the others do not: layer patterns, key heads
shared by several value heads (or not), key and value head widths that differ, partial
RoPE, tied embeddings, prompts longer than one delta-rule chunk (64 tokens), and the rule
that a state page is never read before a request's first chunk writes it.
"""

from __future__ import annotations

import json

import pytest
import torch

from kv.cache_buffers import allocate_caches
from kv.cache_group import cdiv
from kv.cache_layout import plan_layout
from models.batch import SeqChunk, build_forward_batch
from models.loader import load_model
from models.model_files import ModelLoadError
from models.reference import greedy_generate
from tests.models.hf_fixtures import save_hf_model

VARIANTS = {
    "alternating-tied-half-rope": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    ),
    "equal-heads-narrow-keys": dict(
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        linear_key_head_dim=8,
        linear_value_head_dim=24,
        num_key_value_heads=1,
        linear_conv_kernel_dim=3,
    ),
}

torch.manual_seed(1)
LONG = [torch.randint(2, 90, (n,)).tolist() for n in (150, 65, 9, 128)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(our model, transformers' model) for one config variant."""
    out = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model("qwen3_5", out, seed=3, **VARIANTS[request.param])
    return load_model(out, dtype=torch.float32).model, ref


def test_dense_logits_match_transformers_across_chunks(pair):
    ours, ref = pair
    ids = torch.tensor([LONG[0], LONG[0][::-1]])
    with torch.no_grad():
        want = ref(ids).logits
        assert (ours.forward_dense(ids) - want).abs().max().item() < 1e-4


def test_paged_prefill_logits_match_transformers(pair):
    ours, ref = pair
    cfg = ours.config
    block = 16
    layout = plan_layout(cfg, "float32", block, num_blocks=64)
    _buffers, caches = allocate_caches(layout, cfg, "cpu")
    per_req = cdiv(max(map(len, LONG)), block)
    ids, next_id = [], 0
    for _ in LONG:
        ids.append([list(range(next_id, next_id + (per_req if g.kind == "attention" else 1))) for g in layout.groups])
        next_id += sum(len(i) for i in ids[-1])
    with torch.no_grad():
        got = ours(
            build_forward_batch(
                [SeqChunk(p, 0, b) for p, b in zip(LONG, ids, strict=False)], layout.groups, block, "cpu"
            ),
            caches,
        )
        want = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in LONG])
    assert (got - want).abs().max().item() < 1e-4


def test_greedy_continuations_match_transformers_generate(pair):
    ours, ref = pair
    for p in LONG[:2]:
        got = greedy_generate(ours, [p], 24, eos_token_id=None, block_size=16)[0]
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert got == want[0, len(p) :].tolist()


@pytest.mark.parametrize("chunk", [1, 50, 64])
def test_chunked_prefill_across_delta_rule_chunks_equals_one_shot(pair, chunk):
    ours, _ = pair
    one_shot = greedy_generate(ours, LONG, 12, None, block_size=16)
    assert greedy_generate(ours, LONG, 12, None, block_size=16, prefill_chunk=chunk) == one_shot


def test_flat_batch_equals_each_alone(pair):
    ours, _ = pair
    alone = [greedy_generate(ours, [p], 12, None, block_size=16)[0] for p in LONG]
    assert greedy_generate(ours, LONG, 12, None, block_size=16) == alone


def test_state_page_is_not_read_before_the_first_chunk_writes_it(pair):
    """State pages are never zeroed (docs/design.md §1), so whatever a page's last owner left, a
    NaN included, must not reach a new request: its first chunk starts from zeros."""
    ours, _ = pair
    cfg = ours.config
    block = 16
    layout = plan_layout(cfg, "float32", block, num_blocks=32)
    _buffers, caches = allocate_caches(layout, cfg, "cpu")
    prompt = LONG[1]
    ids = [list(range(0, 5)) if g.kind == "attention" else [10 + i] for i, g in enumerate(layout.groups)]
    batch = build_forward_batch([SeqChunk(prompt, 0, ids)], layout.groups, block, "cpu")
    with torch.no_grad():
        clean = ours(batch, caches)
        for g, group in enumerate(layout.groups):
            if group.kind == "mamba":
                for layer in group.layer_ids:
                    caches[layer][0][ids[g][0]] = float("nan")
                    caches[layer][1][ids[g][0]] = float("nan")
        stale = ours(batch, caches)
    assert torch.isfinite(stale).all()
    assert torch.equal(stale, clean)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        (
            "layer_types",
            ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            "sliding_attention",
        ),
        ("layer_types", ["linear_attention", "full_attention"], "num_hidden_layers"),
        ("hidden_act", "gelu", "gelu"),
        ("linear_num_value_heads", 3, "linear_num_value_heads"),
    ],
)
def test_unservable_config_is_named(tmp_path, field, value, named):
    save_hf_model("qwen3_5", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=named):
        load_model(tmp_path)
