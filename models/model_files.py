"""A model directory's JSON files: `config.json` and `generation_config.json`.

Torch-free: the engine and the API read these to size the scheduler and to know the EOS token,
and neither loads torch (docs/design.md §14); the weights are models/loader.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.config import ConfigError, ModelConfig


class ModelLoadError(ValueError):
    """The model directory cannot be served; the message names the file, field or tensor."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"missing file {path}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        return ModelConfig.from_hf_dict(read_json(path))
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def load_generation_config(model_dir: str | Path, cfg: ModelConfig) -> tuple[dict[str, Any] | None, int | None]:
    """`generation_config.json` if present, and the EOS id (it overrides config.json's)."""
    gen_path = Path(model_dir) / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else None
    eos = cfg.eos_token_id
    if generation and generation.get("eos_token_id") is not None:
        e = generation["eos_token_id"]
        eos = e[0] if isinstance(e, list) else e
    return generation, eos
