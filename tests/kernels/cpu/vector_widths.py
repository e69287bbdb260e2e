"""The panel kernel's vector widths as test parameters: 256 bits on every CPU, 512 where the CPU
has AVX-512. The kernel picks AVX-512 at run time (one build serves both), so a CPU without it
skips that width and says which feature it lacks."""

from __future__ import annotations

import pytest

from kernels.cpu.ops import cpu_features

VECTOR_BITS = [
    256,
    pytest.param(
        512,
        marks=pytest.mark.skipif(
            "avx512f" not in cpu_features(), reason="this CPU has no AVX-512 (no avx512f in /proc/cpuinfo)"
        ),
    ),
]
