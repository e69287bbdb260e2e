"""A worker's kernel choice: decided once from its config and the CPU, frozen, installed for its
process (tests install theirs for a block and get the previous one back), and said in one
start-up line."""

from __future__ import annotations

import re
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import torch

from kernels.cpu import ops as cpu_kernels


def test_on_a_cpu_the_kernels_run_at_this_cpus_widest_vectors():
    choice = cpu_kernels.decide(True, torch.device("cpu"))
    assert choice.on, choice.why
    assert (
        choice.vector_bits
        == cpu_kernels.panel_vector_bits()
        == (512 if "avx512f" in cpu_kernels.cpu_features() else 256)
    )
    assert choice.panel_rows == (cpu_kernels.panel_row_limit() if torch.backends.mkldnn.is_available() else 0)


def test_a_cpu_without_avx512_takes_the_256_bit_path(monkeypatch):
    """What an AVX2-only CPU decides: its flags lack avx512f, whatever the kernel's own check."""
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"avx", "avx2", "fma", "sse4_2"}))
    choice = cpu_kernels.decide(True)
    assert choice.on and choice.vector_bits == 256
    assert choice.panel_rows == (cpu_kernels.panel_row_limit(256) if torch.backends.mkldnn.is_available() else 0)
    with pytest.raises(ValueError, match="invalid cpu_vectors 'avx512': this CPU has no AVX-512"):
        cpu_kernels.decide(True, "cpu", "avx512")


def test_cpu_vectors_avx2_runs_the_256_bit_path_on_any_cpu():
    choice = cpu_kernels.decide(True, "cpu", "avx2")
    assert choice.on and choice.vector_bits == 256
    assert choice.panel_rows == (cpu_kernels.panel_row_limit(256) if torch.backends.mkldnn.is_available() else 0)
    assert cpu_kernels.decide(True, "cpu", "auto") == cpu_kernels.decide(True)
    with pytest.raises(ValueError, match="invalid cpu_vectors 'sse': must be one of auto, avx2, avx512"):
        cpu_kernels.decide(True, "cpu", "sse")


def test_with_avx512_a_model_beyond_the_last_level_cache_takes_the_kernel_for_fewer_rows():
    """Streamed from memory (weights past the last-level cache) oneDNN's AVX-512 matmul is as
    fast at one and two rows and faster from four on an Intel Xeon; on an AMD EPYC the kernel
    stays ahead up to six rows, one pass over the stream. Within the cache the kernel is faster
    up to eight on both. The AVX2 path keeps its sixteen rows either way."""
    llc = cpu_kernels.last_level_cache_bytes()
    assert llc >= 1 << 20
    for vendor in ("GenuineIntel", "AuthenticAMD", ""):
        assert cpu_kernels.panel_row_limit(512, vendor=vendor) == cpu_kernels.panel_row_limit(512, llc, vendor) == 8
        assert (
            cpu_kernels.panel_row_limit(256, vendor=vendor) == cpu_kernels.panel_row_limit(256, 10 * llc, vendor) == 16
        )
    assert cpu_kernels.panel_row_limit(512, llc + 1, "GenuineIntel") == 2
    assert cpu_kernels.panel_row_limit(512, llc + 1, "AuthenticAMD") == 6
    assert cpu_kernels.panel_row_limit(512, llc + 1, "") == 2
    this_cpu = cpu_kernels.cpu_vendor()
    assert cpu_kernels.panel_row_limit(512, llc + 1) == cpu_kernels.panel_row_limit(512, llc + 1, this_cpu)
    for vectors in ("auto", "avx2"):
        choice = cpu_kernels.decide(True, "cpu", vectors, weight_bytes=10 * llc)
        expected = cpu_kernels.panel_row_limit(choice.vector_bits, 10 * llc)
        assert choice.panel_rows == (expected if torch.backends.mkldnn.is_available() else 0)


def test_the_cpu_vendor_is_the_one_cpuinfo_names():
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    named = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.MULTILINE)
    assert cpu_kernels.cpu_vendor() == (named.group(1) if named else "")


@pytest.mark.parametrize(
    ("requested", "device", "why"),
    [(False, "cpu", "--no-cpu-kernels"), (True, "cuda", "the device is cuda"), (True, "meta", "the device is meta")],
)
def test_the_config_or_the_device_turns_them_off(requested, device, why):
    choice = cpu_kernels.decide(requested, device)
    assert not choice.on and choice.panel_rows == 0 and why in choice.why
    assert cpu_kernels.summary(choice) == f"CPU kernels off: {choice.why}; panel_linear off"


def test_a_failed_build_turns_them_off_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_built", lambda: (None, "the build failed (OSError: no compiler)"))
    choice = cpu_kernels.decide(True)
    assert not choice.on and "no compiler" in choice.why


def test_a_choice_is_frozen_and_a_block_gets_the_previous_one_back():
    before = cpu_kernels.installed()
    off = cpu_kernels.decide(False)
    with pytest.raises(FrozenInstanceError):
        off.on = True
    with cpu_kernels.using(off):
        assert cpu_kernels.installed() is off and not cpu_kernels.usable(torch.zeros(1))
    assert cpu_kernels.installed() == before and cpu_kernels.usable(torch.zeros(1)) is before.on


def test_the_start_up_line_says_what_runs():
    on = replace(cpu_kernels.decide(True), why="built and loaded from /x", vector_bits=512, panel_rows=8)
    assert cpu_kernels.summary(on) == (
        "CPU kernels on: built and loaded from /x, AVX-512 vectors; panel_linear on up to 8 rows, on every packed layer"
    )
    narrow = replace(on, vector_bits=256, panel_rows=2)
    avx2 = "AVX2" if {"avx2", "fma"} <= cpu_kernels.cpu_features() else "256-bit, no AVX2"
    if "avx512f" in cpu_kernels.cpu_features():
        avx2 += " vectors (--cpu-vectors avx2 on an AVX-512 CPU)"
    else:
        avx2 += " vectors"
    names = [f"layers.{i}.mlp" for i in range(8)]
    assert cpu_kernels.summary(narrow, names) == (
        f"CPU kernels on: built and loaded from /x, {avx2}; panel_linear on up to 2 rows, 8 packed layer(s) left to "
        "oneDNN (layout not the checked one): layers.0.mlp, layers.1.mlp, layers.2.mlp, layers.3.mlp, "
        "layers.4.mlp, layers.5.mlp and 2 more"
    )
    assert cpu_kernels.summary(replace(on, panel_rows=0)).endswith("panel_linear off (no oneDNN packs the weights)")


def test_the_flag_and_the_variable_reach_each_workers_choice():
    """`--cpu-vectors avx2` (or RAYPD_CPU_VECTORS) travels in the engine's config to every worker's,
    which decides by it."""
    from engine.build import worker_config
    from serve.config import load_config

    for cfg in (load_config(["--cpu-vectors", "avx2"], {}), load_config([], {"RAYPD_CPU_VECTORS": "AVX2"})):
        worker = worker_config(cfg)
        assert worker.cpu_vectors == "avx2"
        assert cpu_kernels.decide(worker.cpu_kernels, "cpu", worker.cpu_vectors).vector_bits == 256
    assert worker_config(load_config([], {})).cpu_vectors == "auto"
