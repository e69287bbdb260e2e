"""The kernels' machine code: every kernel is built for AVX2 and FMA only (`-mavx2 -mfma`, not
`-march=native`), so one build runs on an AVX2-only CPU; AVX-512 instructions appear only in
the panel and prefill attention functions built for them (`target("avx512f")`), which run
where the CPU check says so. Read from the built library's disassembly: a flag or attribute that widened any other
kernel would make the library fail on an AVX2 host with an illegal instruction, which no test
on an AVX-512 host would otherwise see."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict

import pytest

from kernels.cpu import ops as cpu_kernels

pytestmark = [
    pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils) to read the kernels' code"),
    pytest.mark.skipif(
        not {"avx2", "fma"} <= cpu_kernels.cpu_features(), reason="the kernels are built for AVX2 only on AVX2 CPUs"
    ),
]

_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
# An AVX-512 register: a 512-bit vector, a mask, or one of the 16 vector registers only EVEX reaches.
_AVX512 = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b")

# A vectorised loop of each kernel, by the function it is compiled into.
_KERNELS = (
    "decode_attention_impl<float>",
    "mamba_ssm_scan(",
    "causal_conv(",
    "::rms_norm(",
    "gated_rms_norm(",
    "panel_row_avx2(",
    "panel_slice_avx2<4>",
    "prefill_attention_avx2(",
)

# The functions built for AVX-512, run only where the CPU has it.
_WIDE = ("panel_group_avx512<", "prefill_attention_avx512(")


@pytest.fixture(scope="module")
def instructions() -> dict[str, list[str]]:
    """Each function of the built library, demangled, with its instructions."""
    kernels = cpu_kernels.load()
    assert kernels is not None, "the CPU kernels did not build"
    text = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", kernels.__file__], capture_output=True, text=True, check=True
    ).stdout
    code: dict[str, list[str]] = defaultdict(list)
    name = ""
    for line in text.splitlines():
        match = _FUNCTION.match(line)
        if match:
            name = match.group(1)
        elif name and "\t" in line:
            code[name].append(line)
    return code


def test_avx512_only_in_the_functions_built_for_it(instructions):
    wide = {name for name, lines in instructions.items() if any(_AVX512.search(line) for line in lines)}
    for built in _WIDE:
        assert any(built in name for name in wide), f"no {built} uses AVX-512: its AVX-512 path is gone"
    assert all(any(built in name for built in _WIDE) for name in wide), sorted(wide)


@pytest.mark.parametrize("kernel", _KERNELS)
def test_each_kernel_is_vectorised_with_avx2(instructions, kernel):
    """256-bit registers in the function its loop is compiled into (a parallel_for's body is
    its own function; any of them counts)."""
    bodies = [lines for name, lines in instructions.items() if kernel in name]
    assert bodies, f"no function named like {kernel!r} in the library"
    assert any("%ymm" in line for lines in bodies for line in lines), f"{kernel} has no 256-bit vector code"
