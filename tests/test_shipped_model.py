"""The shipped checkpoint answers its eval set, and only because it reads the prompt's KV.

These are the facts the PD tests stand on: a decode engine that receives the right KV
matches this accuracy, one whose attention blocks were zeroed after the transfer cannot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.accuracy import evaluate, parse_args
from models.build_tokenizer import EOS_TOKEN_ID
from models.loader import load_model

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-hybrid"


def _accuracy(*flags: str) -> float:
    args = parse_args(["--mode", "local", "--model", str(MODEL_DIR), "--limit", "50", *flags])
    return float(evaluate(args)["accuracy"])


def test_checkpoint_is_a_small_bf16_hybrid() -> None:
    loaded = load_model(MODEL_DIR)
    assert loaded.config.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert len(loaded.config.attention_layers) >= 2 and len(loaded.config.mamba_layers) >= 2
    assert loaded.eos_token_id == EOS_TOKEN_ID
    assert loaded.chat_template is not None
    assert sum(f.stat().st_size for f in MODEL_DIR.iterdir()) < 10 * 2**20
    assert len((MODEL_DIR / "eval.jsonl").read_text().splitlines()) == 200


def test_accuracy_on_eval_prompts() -> None:
    assert _accuracy() >= 0.9


def test_zeroed_kv_collapses_accuracy() -> None:
    assert _accuracy("--zero-kv-after-prefill") < 0.2


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--mode", "nonsense"])
