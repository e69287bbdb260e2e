"""The engine's scheduler takes its step budget by role and by the device the worker reported."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.build import make_scheduler
from engine.config import Config
from engine.scheduler import DisaggConfig
from kv.cache_layout import plan_layout
from models.model_files import load_config


@pytest.mark.parametrize(
    "role, device, budget",
    [(None, "cpu", 2048), ("decode", "cpu", 2048), ("prefill", "cpu", 256), ("prefill", "cuda", 2048)],
)
def test_scheduler_budget_by_role_and_device(role: str | None, device: str, budget: int) -> None:
    cfg = Config()
    model_cfg = load_config(cfg.model)
    layout = replace(plan_layout(model_cfg, "float32", 16, num_blocks=16), device=device)
    disagg = None if role is None else DisaggConfig(role, "engine-0")  # type: ignore[arg-type]
    assert make_scheduler(cfg, model_cfg, layout, disagg).config.max_num_batched_tokens == budget
