"""A model directory's JSON files: `config.json`, `generation_config.json` and the chat template.

Torch-free: the engine and the API read these to size the scheduler and to know the EOS token,
and neither loads torch (docs/design.md §14); the weights are models/loader.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


# The special tokens transformers passes to a chat template (its `special_tokens_map`).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A model directory's chat template and the special tokens it is rendered with."""

    template: str | None
    special_tokens: dict[str, str]


def load_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The template transformers would use, from the forms released directories ship:
    `chat_template.jinja` (Qwen3.5, transformers 5), `chat_template.json` (a processor's),
    or `tokenizer_config.json`'s `chat_template`, a string (Qwen3) or a list of named templates
    (NVIDIA), of which the one named `default` is the chat's. Special tokens are strings or
    added-token objects (`{"content": ...}`) in `tokenizer_config.json`."""
    path = Path(model_dir)
    tok_path = path / "tokenizer_config.json"
    tok_cfg = read_json(tok_path) if tok_path.exists() else {}
    special = {}
    for name in _SPECIAL_TOKENS:
        value = tok_cfg.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    jinja, processor = path / "chat_template.jinja", path / "chat_template.json"
    template: Any
    if jinja.exists():
        template = jinja.read_text()
    elif processor.exists():
        template = read_json(processor).get("chat_template")
    else:
        template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values())) if len(named) == 1 else None)
        if template is None:
            raise ModelLoadError(f"{tok_path}: chat_template lists {sorted(map(str, named))}, none named 'default'")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{tok_path}: chat_template is a {type(template).__name__}, not a string")
    return ChatTemplate(template, special)
