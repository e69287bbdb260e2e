"""The shipped checkpoints answer their eval sets, and only because they read the prompt's KV.

These are the facts the PD tests stand on: a decode engine that receives the right KV
matches this accuracy, one whose attention blocks were zeroed after the transfer cannot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.accuracy import evaluate, parse_args
from models.loader import load_model
from training.build_tokenizer import EOS_TOKEN_ID

MODELS = Path(__file__).resolve().parents[1] / "models"
# The NemotronH-style hybrid (Mamba2 + attention) and the Qwen3.5-style one (Gated DeltaNet + gated attention).
SHIPPED = pytest.mark.parametrize("model_dir", [MODELS / "tiny-hybrid", MODELS / "tiny-qwen35"], ids=lambda p: p.name)


def _accuracy(model_dir: Path, *flags: str) -> float:
    args = parse_args(["--mode", "local", "--model", str(model_dir), "--limit", "50", *flags])
    return float(evaluate(args)["accuracy"])


@SHIPPED
def test_checkpoint_is_a_small_bf16_hybrid(model_dir: Path) -> None:
    loaded = load_model(model_dir)
    assert loaded.config.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert len(loaded.config.attention_layers) >= 2 and len(loaded.config.mamba_layers) >= 2
    assert loaded.eos_token_id == EOS_TOKEN_ID
    assert loaded.chat_template is not None
    assert sum(f.stat().st_size for f in model_dir.iterdir()) < 10 * 2**20
    assert len((model_dir / "eval.jsonl").read_text().splitlines()) == 200


@SHIPPED
def test_accuracy_on_eval_prompts(model_dir: Path) -> None:
    assert _accuracy(model_dir) >= 0.9


@SHIPPED
def test_zeroed_kv_collapses_accuracy(model_dir: Path) -> None:
    assert _accuracy(model_dir, "--zero-kv-after-prefill") < 0.2


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--mode", "nonsense"])
