"""bench.background: its ratios are each setting's mean over the mean of the runs alone, the
preemption counter reads this process's threads while the engine's are alive, and bad arguments
are refused by name before any checkpoint is made or server started."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import threading
from pathlib import Path

import pytest

from bench import background, real_step
from engine.config import DEFAULT_MODEL


def test_ratios_are_each_setting_s_mean_over_the_mean_of_the_runs_alone():
    rows = [
        {"setting": "alone", "ttft_ms": 400.0, "tpot_ms": 90.0},
        {"setting": "beside_raypd", "ttft_ms": 500.0, "tpot_ms": 100.0},
        {"setting": "alone", "ttft_ms": 480.0, "tpot_ms": 110.0},
        {"setting": "beside_vllm", "ttft_ms": 440.0, "tpot_ms": 99.0},
        {"setting": "beside_raypd", "ttft_ms": 600.0, "tpot_ms": 120.0},
        {"setting": "alone", "ttft_ms": 440.0, "tpot_ms": 100.0},
    ]
    assert background.ratios(rows) == {
        "background_raypd_ttft": 1.25,
        "background_raypd_tpot": 1.1,
        "background_vllm_ttft": 1.0,
        "background_vllm_tpot": 0.99,
    }


def test_the_count_is_read_while_the_engine_s_threads_run():
    """`engine_figures` calls back before it closes the engine: the compute stream's thread
    (and its OpenMP team) is alive then, and gone after, with its switches."""
    seen: list[list[str]] = []
    args = argparse.Namespace(threads=1, prompt_len=8, max_tokens=3, repeats=1)
    asyncio.run(real_step.engine_figures(Path(DEFAULT_MODEL), args, lambda: seen.append(_thread_names())))
    assert len(seen) == 1
    assert any(name.startswith("compute-stream") for name in seen[0])
    assert not any(name.startswith("compute-stream") for name in _thread_names())


def _thread_names() -> list[str]:
    return [t.name for t in threading.enumerate()]


def test_preemptions_are_counted_over_this_process_s_threads():
    """Two threads that hash without the GIL on one CPU take the core from each other: the
    count, summed over the live threads, goes up (read before they end: an ended thread's
    switches leave /proc with it)."""
    cpu = min(os.sched_getaffinity(0))
    data = b"x" * (32 << 20)
    hashed = threading.Barrier(3)
    counted = threading.Event()

    def hash_on_one_cpu() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        for _ in range(6):
            hashlib.sha256(data).digest()
        hashed.wait()
        counted.wait()

    before = background.involuntary_switches()
    threads = [threading.Thread(target=hash_on_one_cpu) for _ in range(2)]
    for t in threads:
        t.start()
    hashed.wait()
    after = background.involuntary_switches()
    counted.set()
    for t in threads:
        t.join()
    assert after > before


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model", "nope"], "nope"),
        (["--beside", "raypd,sglang"], "sglang"),
        (["--beside", "vllm", "--vllm-python", "/nonexistent/python"], "--vllm-python"),
        (["--max-tokens", "1"], "--max-tokens"),
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, named, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["background", "--work-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit):
        background.main()
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
