"""Every way a model directory cannot be served is a ModelLoadError naming the file, tensor or
field, for single-file and sharded (indexed) checkpoints alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import checkpoint_bytes, load_model
from models.model_files import ModelLoadError


@pytest.fixture
def model_dir(hf_model, tmp_path):
    _, path, _ = hf_model
    out = tmp_path / "m"
    shutil.copytree(path, out)
    return out


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: the one file, or the index's shards."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return [model_dir / "model.safetensors"]
    return [model_dir / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


def file_holding(model_dir: Path, suffix: str) -> tuple[Path, str]:
    """The weight file with a served tensor (not the vision tower's) whose name ends in
    `suffix`, and that name."""
    for path in weight_files(model_dir):
        name = next((k for k in load_file(path) if k.endswith(suffix) and "visual" not in k), None)
        if name is not None:
            return path, name
    raise AssertionError(f"no tensor ends in {suffix}")


@pytest.mark.parametrize("name", ["config.json", "weights", "tokenizer.json"])
def test_missing_file_is_named(model_dir, name):
    """`weights`: model.safetensors, or a shard the index lists."""
    path = weight_files(model_dir)[-1] if name == "weights" else model_dir / name
    path.unlink()
    with pytest.raises(ModelLoadError, match=path.name):
        load_model(model_dir)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unknown_architecture_is_named(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    cfg["model_type"] = "mystery"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="MysteryForCausalLM"):
        load_model(model_dir)


@pytest.mark.parametrize("suffix", ["o_proj.weight", "experts.1.down_proj.weight"])
def test_wrong_tensor_shape_is_named(hf_model, model_dir, suffix):
    if "experts" in suffix and not hf_model[0].endswith("_moe"):
        suffix = "down_proj.weight"  # a dense model's MLP
    path, name = file_holding(model_dir, suffix)
    weights = load_file(path)
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] + 1)
    save_file(weights, path)
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(model_dir)


def test_missing_tensor_is_named(model_dir):
    path, name = file_holding(model_dir, "norm.weight")
    weights = load_file(path)
    del weights[name]
    save_file(weights, path)
    with pytest.raises(ModelLoadError, match="lacks"):
        load_model(model_dir)


def test_unknown_layer_type_is_named(hf_model, model_dir):
    kind = hf_model[0]
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if kind.startswith("nemotron_h"):
        field = "layers_block_type" if "layers_block_type" in text else "hybrid_override_pattern"
        text[field] = [*text[field][:-1], "cross_attention"] if field == "layers_block_type" else text[field] + "X"
    elif kind.startswith("qwen3_5"):
        text["layer_types"] = [*text["layer_types"][:-1], "sliding_attention"]
    else:  # Qwen3 names no layer types: its sliding-window layers are switched on instead
        text["use_sliding_window"] = True
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"cross_attention|'X'|sliding_attention|use_sliding_window"):
        load_model(model_dir)


def test_sharded_checkpoint_loads(model_dir):
    weights = {k: v for path in weight_files(model_dir) for k, v in load_file(path).items()}
    for path in weight_files(model_dir):
        path.unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, model_dir / shard)
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(model_dir, dtype=torch.float32)
    head = loaded.model.lm_head  # fp32 on the CPU: its weight is held packed for oneDNN
    ours = head.weight if head.packed is None else head.packed.to_dense()
    name = next(n for n in names if n.endswith("lm_head.weight"))
    assert torch.equal(ours, weights[name])
    assert checkpoint_bytes(model_dir) == sum(p.stat().st_size for p in weight_files(model_dir)) > 0
