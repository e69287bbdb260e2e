"""Load and save models in Hugging Face's on-disk format.

Reads `config.json`, `model.safetensors` (or a sharded index), `tokenizer.json` through the
`tokenizers` library, and `generation_config.json` and a chat template when present.
Every way a directory can be unusable is a `ModelLoadError` naming the file or tensor. The
JSON files alone are read by models/model_files.py, which the processes without torch use.

Checkpoint names become the model's by prefix (`_ALIASES`); a released multimodal directory's
vision tower and multi-token-prediction weights are skipped (`_SKIPPED`) and named once in the
log. Experts load from either layout on disk: one tensor per expert (`experts.N.up_proj.weight`,
as released checkpoints and `save_pretrained` write them) or fused 3D tensors
(`experts.gate_up_proj`, `experts.down_proj`, transformers' in-memory layout).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from models.config import ConfigError, ModelConfig
from models.layers import collapse_panels, pack_linears, stack_projections
from models.model_files import ModelLoadError, load_chat_template, load_config, load_generation_config, read_json
from models.nemotron_h import NemotronHForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_5 import Qwen3_5ForCausalLM
from models.tensor_parallel import SINGLE, TPGroup, shard_weights
from models.tp_shards import shard_config

_CLASSES: dict[str, type[nn.Module]] = {
    "nemotron_h": NemotronHForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
}
log = logging.getLogger(__name__)

# Older NemotronH checkpoints name the backbone `backbone.`; transformers 5 names it `model.`.
# A multimodal wrapper (Qwen3.5's `…ForConditionalGeneration`) holds its text model under
# `model.language_model.`.
_ALIASES = (("backbone.", "model."), ("model.language_model.", "model."))
# Beside the language model, not served: the vision tower and the multi-token-prediction heads.
_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")
# Experts fused into one [experts, out, in] tensor per projection.
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|up_proj|down_proj)")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_id: int | None
    generation: dict[str, Any] | None
    chat_template: str | None
    skipped: tuple[str, ...] = ()  # checkpoint tensors not served (vision tower, MTP heads)


def checkpoint_bytes(model_dir: str | Path) -> int:
    """The bytes of the checkpoint's weight files, read before loading them: how much memory a
    decode step streams, which decides the CPU kernels a worker runs (kernels/cpu/ops.py)."""
    return sum(f.stat().st_size for f in _weight_files(Path(model_dir)))


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise ModelLoadError(f"missing weight shard(s) {missing} listed in {index}")
        return [model_dir / s for s in shards]
    raise ModelLoadError(f"missing file {single} (and no model.safetensors.index.json)")


def _read_weights(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Tensors under our parameter names, each one's name in the checkpoint (for errors), and
    the names of the tensors skipped."""
    tensors: dict[str, torch.Tensor] = {}
    original: dict[str, str] = {}
    skipped: list[str] = []
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if name.startswith(_SKIPPED):
                    skipped.append(name)
                    continue
                key = name
                for old, new in _ALIASES:
                    if key.startswith(old):
                        key = new + key[len(old) :]
                for part, t in _unfused(key, name, f.get_tensor(name)):
                    tensors[part] = t
                    original[part] = name
    return tensors, original, sorted(skipped)


def _unfused(key: str, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused experts tensor as the per-expert tensors the model holds; any other as is."""
    m = _FUSED_EXPERTS.fullmatch(key)
    if m is None:
        return [(key, t)]
    if t.dim() != 3:
        raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}, expected [experts, out, in]")
    prefix, proj = m.groups()
    if proj != "gate_up_proj":
        return [(f"{prefix}.{i}.{proj}.weight", w) for i, w in enumerate(t.unbind(0))]
    if t.shape[1] % 2:
        raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}: its gate and up halves are unequal")
    parts = []
    for i, w in enumerate(t.unbind(0)):
        gate, up = w.chunk(2)
        parts += [(f"{prefix}.{i}.gate_proj.weight", gate), (f"{prefix}.{i}.up_proj.weight", up)]
    return parts


def _assign(model: nn.Module, weights: dict[str, torch.Tensor], original: dict[str, str], tied: bool) -> None:
    expected = model.state_dict()
    if tied:
        weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint has unknown tensor(s) {[original[k] for k in unexpected[:5]]}")
    for name, t in weights.items():
        if t.shape != expected[name].shape:
            raise ModelLoadError(
                f"tensor {original[name]} has shape {tuple(t.shape)}, the config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=not tied)


def build_model(cfg: ModelConfig, tp: TPGroup = SINGLE) -> nn.Module:
    """The model class for `cfg.architecture`, with its modules' own initial weights."""
    return _CLASSES[cfg.architecture](cfg, tp)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp: TPGroup = SINGLE,
) -> LoadedModel:
    """Build the inference model for `config.json`, fill it from safetensors, cast to `dtype`
    (default: the checkpoint's dtype), move it to `device` and pack its fp32 CPU linears. Under tensor parallelism the model is
    rank `tp.rank`'s share and the returned config is that rank's local config."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    cfg = load_config(path)
    tok_path = path / "tokenizer.json"
    if not tok_path.exists():
        raise ModelLoadError(f"missing file {tok_path}")
    tokenizer = Tokenizer.from_file(str(tok_path))
    try:
        local = shard_config(cfg, tp.rank, tp.size)
    except ConfigError as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None
    model = build_model(local, tp)
    weights, original, skipped = _read_weights(path)
    if skipped:
        log.info("%s: %d tensors not served (vision tower, multi-token prediction): %s", path, len(skipped), skipped)
    _assign(model, shard_weights(cfg, weights, tp.rank, tp.size), original, cfg.tie_word_embeddings)
    model = model.to(dtype=dtype or getattr(torch, cfg.dtype), device=device).eval()
    stack_projections(model)
    pack_linears(model)
    if moved := collapse_panels(model):
        log.info("%s: %.2f GB of decode weights on 2 MiB pages", path, moved / 1e9)
    generation, eos = load_generation_config(path, cfg)
    template = load_chat_template(path).template
    return LoadedModel(model, local, tokenizer, eos, generation, template, tuple(skipped))


def save_model(model: nn.Module, hf_config: dict[str, Any], out_dir: str | Path) -> None:
    """Write `config.json` and `model.safetensors` (tensors in their current dtype)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if hf_config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
