from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import load_model
from models.model_files import ModelLoadError


@pytest.fixture
def model_dir(hf_model, tmp_path):
    _, path, _ = hf_model
    out = tmp_path / "m"
    shutil.copytree(path, out)
    return out


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(model_dir, name):
    (model_dir / name).unlink()
    with pytest.raises(ModelLoadError, match=name):
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


def test_wrong_tensor_shape_is_named(model_dir):
    weights = load_file(model_dir / "model.safetensors")
    name = next(k for k in weights if k.endswith("o_proj.weight"))
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] + 1)
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(model_dir)


def test_missing_tensor_is_named(model_dir):
    weights = load_file(model_dir / "model.safetensors")
    name = sorted(weights)[3]
    del weights[name]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks"):
        load_model(model_dir)


def test_sharded_checkpoint_loads(model_dir):
    weights = load_file(model_dir / "model.safetensors")
    names = sorted(weights)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, model_dir / shard)
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()
    loaded = load_model(model_dir, dtype=torch.float32)
    head = loaded.model.lm_head  # fp32 on the CPU: its weight is held packed for oneDNN
    ours = head.weight if head.packed is None else head.packed.to_dense()
    name = next(n for n in names if n.endswith("lm_head.weight"))
    assert torch.equal(ours, weights[name])
