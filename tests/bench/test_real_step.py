"""bench.real_step: its in-process engine run yields one TTFT and one TPOT from real token
arrivals (on the shipped tiny model, not a real-size one), and bad arguments are refused by
name before any checkpoint is made."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

import pytest

from bench import real_step
from engine.config import DEFAULT_MODEL


def test_the_engine_figures_come_from_each_token_s_arrival():
    args = argparse.Namespace(threads=1, prompt_len=8, max_tokens=3, repeats=1)
    ttft, tpot = asyncio.run(real_step.engine_figures(Path(DEFAULT_MODEL), args))
    assert 0 < ttft < math.inf and 0 < tpot < math.inf


@pytest.mark.parametrize(
    ("argv", "named"), [(["--models", "dense,nope"], "nope"), (["--max-tokens", "1"], "--max-tokens")]
)
def test_bad_arguments_are_refused_by_name(argv, named, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["real_step", *argv])
    with pytest.raises(SystemExit):
        real_step.main()
    assert named in capsys.readouterr().err
