"""The mixture-of-experts layer and what loading MoE checkpoints adds.

tests/models/test_models.py checks every MoE kind against transformers (logits, greedy,
chunked prefill, flat batches) and tests/models/test_tensor_parallel.py TP=2 against TP=1;
these check the two other released classes (dense Qwen3.5 in its multimodal wrapper,
Qwen3.5-MoE's text model alone), the grouped expert run against the per-token sum it stands
for, both on-disk expert layouts, the released multimodal directory's skipped tensors, and
the configs the engine refuses.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.config import ConfigError, ModelConfig
from models.loader import load_model
from models.mlp import GatedMLP, Relu2MLP
from models.model_files import ModelLoadError
from models.moe import run_experts
from models.reference import greedy_generate
from models.tensor_parallel import TPGroup
from tests.models.hf_fixtures import RELEASED_KINDS, save_hf_model
from tests.models.test_loader_errors import weight_files


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (directory, transformers model) for the two released layouts checked here."""
    out = {}
    for kind in ("qwen3_5_moe", "nemotron_h_moe"):
        path = tmp_path_factory.mktemp(kind)
        out[kind] = (path, save_hf_model(kind, path))
    return out


@pytest.mark.parametrize("kind", RELEASED_KINDS)
def test_other_released_classes_match_transformers(tmp_path, kind):
    """Logits within 1e-4, greedy continuations equal to `generate`, chunked prefill equal to
    one shot."""
    ref = save_hf_model(kind, tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32).model
    prompts = [torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 23)]
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        assert (ours.forward_dense(ids) - ref(ids).logits).abs().max().item() < 1e-4
        for p in prompts:
            want = ref.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert greedy_generate(ours, [p], 16, None, block_size=4)[0] == want[0, len(p) :].tolist()
    one_shot = greedy_generate(ours, prompts, 8, None, block_size=4)
    assert greedy_generate(ours, prompts, 8, None, block_size=4, prefill_chunk=9) == one_shot


@pytest.mark.parametrize("gated", [True, False])
@torch.inference_mode()
def test_grouped_experts_equal_the_per_token_sum(gated):
    """Every token's weighted sum over its own experts, one (token, k) at a time, including
    tokens that pick the same expert and experts nobody picks."""
    torch.manual_seed(0)
    experts = nn.ModuleList(GatedMLP(16, 8) if gated else Relu2MLP(16, 8, bias=True) for _ in range(6))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    x = torch.randn(37, 16)
    ids = torch.randint(0, 5, (37, 3))  # expert 5 is never picked
    weights = torch.rand(37, 3)
    want = torch.stack([sum(weights[t, k] * experts[int(ids[t, k])](x[t]) for k in range(3)) for t in range(37)])
    assert (run_experts(experts, x, weights, ids) - want).abs().max().item() < 1e-5


def _fuse(path, gated: bool) -> None:
    """Rewrite a per-expert checkpoint as fused [experts, out, in] tensors (transformers'
    in-memory layout, which some converted checkpoints keep), in two shards."""
    weights = {}
    for file in weight_files(path):
        weights |= load_file(file)
        file.unlink()
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in weights if ".experts." in n]:
        prefix, rest = name.split(".experts.")
        index, proj, _ = rest.split(".")
        groups.setdefault(prefix, {}).setdefault(int(index), {})[proj] = weights.pop(name)
    for prefix, experts in groups.items():
        order = [experts[i] for i in sorted(experts)]
        if gated:
            weights[f"{prefix}.experts.gate_up_proj"] = torch.stack(
                [torch.cat([e["gate_proj"], e["up_proj"]]) for e in order]
            )
        else:
            weights[f"{prefix}.experts.up_proj"] = torch.stack([e["up_proj"] for e in order])
        weights[f"{prefix}.experts.down_proj"] = torch.stack([e["down_proj"] for e in order])
    names = sorted(weights)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, path / shard)
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "nemotron_h_moe"])
def test_fused_expert_layout_loads_the_same_model(saved, tmp_path, kind):
    path, ref = saved[kind]
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    _fuse(fused, gated=kind.startswith("qwen"))
    ids = torch.randint(2, 90, (1, 30))
    with torch.no_grad():
        got = load_model(fused, dtype=torch.float32).model.forward_dense(ids)
        assert (got - ref(ids).logits).abs().max().item() < 1e-4


def test_vision_tower_and_mtp_weights_are_skipped_and_logged_once(saved, caplog):
    path, _ = saved["qwen3_5_moe"]
    on_disk = [n for f in weight_files(path) for n in load_file(f)]
    with caplog.at_level(logging.INFO, logger="models.loader"):
        loaded = load_model(path, dtype=torch.float32)
    want = sorted(n for n in on_disk if n.startswith(("model.visual.", "mtp.")))
    assert "mtp.fc.weight" in want and any(n.startswith("model.visual.") for n in want)
    assert list(loaded.skipped) == want
    (record,) = [r for r in caplog.records if "not served" in r.getMessage()]
    assert "mtp.fc.weight" in record.getMessage()
    assert loaded.config.moe is not None and loaded.config.architecture == "qwen3_5"


def _config(saved, kind: str) -> dict:
    return json.loads((saved[kind][0] / "config.json").read_text())


@pytest.mark.parametrize(
    ("kind", "field", "value", "named"),
    [
        ("nemotron_h_moe", "n_group", 3, "n_group"),
        ("nemotron_h_moe", "topk_group", 3, "topk_group"),
        ("nemotron_h_moe", "num_experts_per_tok", 9, "num_experts_per_tok"),
        ("nemotron_h_moe", "mlp_hidden_act", "gelu", "mlp_hidden_act"),
        ("qwen3_5_moe", "num_experts_per_tok", 0, "num_experts_per_tok"),
        ("qwen3_5_moe", "hidden_act", "gelu", "hidden_act"),
        ("qwen3_5_moe", "moe_intermediate_size", None, "moe_intermediate_size"),
        ("qwen3_5_moe", "text_config", "text", "text_config"),
        ("qwen3_5_moe", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ],
)
def test_unservable_moe_config_is_named(saved, kind, field, value, named):
    d = _config(saved, kind)
    target = d["text_config"] if kind == "qwen3_5_moe" and field != "text_config" else d
    if value is None:
        del target[field]
    else:
        target[field] = value
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_dict(d)


def test_expert_width_that_does_not_split_over_tp_is_named(tmp_path):
    save_hf_model("qwen3_moe", tmp_path, moe_intermediate_size=33)
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        load_model(tmp_path, tp=TPGroup(0, 2))


def test_qwen3_moe_sparse_layers_follow_mlp_only_layers_and_step(saved):
    d = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.moe is not None and cfg.moe.layers == (1, 5)


def test_correction_bias_stays_fp32_in_a_bf16_model(saved):
    """As transformers keeps it: it separates sigmoid scores closer than bf16 can tell apart."""
    path, ref = saved["nemotron_h_moe"]
    model = load_model(path, dtype=torch.bfloat16).model
    ours = model.model.layers[1].mixer.gate
    assert ours.weight.dtype == torch.bfloat16
    assert ours.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.e_score_correction_bias, ref.model.layers[1].mixer.gate.e_score_correction_bias)
