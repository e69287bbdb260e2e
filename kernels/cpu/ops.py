"""The C++ CPU kernels (kernels/cpu/csrc/cpu_kernels.cpp), built on first use.

On a CPU a decode step's attention gathered every request's K/V pages into one tensor and
then read the copy again, and Mamba2 ran a chunked scan of ~25 small ops per prefill chunk.
The kernels (paged decode attention, K/V writes, Mamba2's convolution and recurrence over a
step's tokens, RMS norm) read pages and states where they lie, in one call each
(docs/design.md §13). They are compiled once per source into `.venv/torch_extensions` (about a
minute; `make setup` does it, so engines start with them built). Where no compiler works the
engines run the torch path, which is also the path on a GPU, and say so once in the log.

Which kernels run is a `KernelChoice`, decided once when a worker starts (`decide`, from its
config and the CPU), installed once for its process (`install`) and said in its start-up log
(`summary`); every layer reads that one frozen value.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import shutil
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"


@cache
def _cpuinfo() -> str:
    """/proc/cpuinfo's text, read once a process; "" where it cannot be read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpuinfo_field(name: str, info: str | None = None) -> str:
    """The value of the first `name` line (the first CPU's) of a /proc/cpuinfo text (None: this
    machine's); "" where there is none."""
    text = _cpuinfo() if info is None else info
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name)), "")


@cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (avx2, fma, avx512f, ...); none
    where it cannot be read."""
    return frozenset(cpuinfo_field("flags").split())


@cache
def cpu_vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD); "" where it
    cannot be read."""
    return cpuinfo_field("vendor_id")


def _cpu_flags() -> list[str]:
    """AVX2 and FMA where this CPU has them: the kernels' inner loops are 64-float dot
    products and updates, twice as wide as with the SSE2 that x86-64 guarantees. Not
    `-march=native`, so a build stays usable on another x86-64 host with AVX2."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_features() else []


def _build_dir() -> Path:
    """Beside the interpreter's environment, one per source: checkouts of different sources
    sharing an environment (a benchmark's A/B) would otherwise rebuild over each other."""
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    root = Path(sys.prefix) / "torch_extensions" / f"raypd_cpu_kernels_{digest}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (`_built` says why)."""
    return _built()[0]


@cache
def _built() -> tuple[ModuleType | None, str]:
    """The compiled kernels, or None and why they are not.

    torch guards a build with a lock file that a killed build leaves behind, and every later
    load then waits on it forever (an interrupted `make setup` would hang every engine's
    start). So builds here are serialised by an `flock` on a file of our own, which the kernel
    drops when its holder dies: whoever holds it knows a torch lock file it finds is stale.
    The source is built from a copy in the build directory, the same path for every checkout
    of that source: torch's build file names the source's path, and two checkouts sharing an
    environment would otherwise each find the other's build out of date."""
    from torch.utils.cpp_extension import load as build

    root = _build_dir()
    try:
        with open(root / "build.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (root / "lock").unlink(missing_ok=True)
            source = root / _SOURCE.name
            if not source.is_file() or source.read_bytes() != _SOURCE.read_bytes():
                shutil.copyfile(_SOURCE, source)
            kernels = build(
                name="raypd_cpu_kernels",
                sources=[str(source)],
                extra_cflags=["-O3", "-fno-trapping-math", "-fopenmp", *_cpu_flags()],
                extra_ldflags=["-fopenmp"],
                build_directory=str(root),
            )
            return kernels, f"built and loaded from {root}"
    except (OSError, RuntimeError, ImportError) as exc:
        log.warning("CPU kernels unavailable, running the torch path: %s", exc)
        first_line = next(iter(str(exc).splitlines()), "")
        return None, f"the build failed ({type(exc).__name__}: {first_line})"


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """Which CPU kernels a worker runs, decided once when it starts (`decide`) and installed once
    for its process (`install`).

    One frozen value, not a switch any caller could flip at run time: whether the kernels run,
    panel_linear's vector width and its row limit were three pieces of state (a class
    attribute, the CPU read at every call, the panels each Linear took when packed) that could
    disagree, and none said why. A process runs, for its whole life, the kernels its start-up
    line named (`summary`)."""

    on: bool  # the C++ kernels run wherever the tensors allow (`usable`)
    why: str  # why they are on or off, for the start-up log
    vector_bits: int = 0  # panel_linear's vector width: 512 (AVX-512) or 256
    panel_rows: int = 0  # up to how many rows a packed Linear takes panel_linear; 0: never


# `--cpu-vectors`: the vector width each value asks for; auto (0) takes the widest this CPU has.
_VECTORS = {"auto": 0, "avx2": 256, "avx512": 512}


def decide(
    requested: bool, device: torch.device | str = "cpu", vectors: str = "auto", weight_bytes: int = 0
) -> KernelChoice:
    """The kernels a worker on `device` runs: on a CPU, unless its config turned them off
    (`--no-cpu-kernels`) or they did not build; the vectors `vectors` names (`--cpu-vectors`:
    "avx2" runs an AVX2-only CPU's path on any CPU, so that it can be measured and tested on an
    AVX-512 host), by default the widest this CPU has; panel_linear up to that width's row limit
    for a model of `weight_bytes` (`panel_row_limit`) where oneDNN packs the weights it reads.
    AVX-512 needs both /proc/cpuinfo's avx512f and the kernel's own check
    (`panel_vector_bits`), so a CPU whose flags lack it takes 256 bits."""
    if vectors not in _VECTORS:
        raise ValueError(f"invalid cpu_vectors {vectors!r}: must be one of {', '.join(_VECTORS)}")
    device = torch.device(device)
    if device.type != "cpu":
        return KernelChoice(False, f"the device is {device.type}, the torch path")
    if not requested:
        return KernelChoice(False, "--no-cpu-kernels, the torch path")
    kernels, why = _built()
    if kernels is None:
        return KernelChoice(False, f"{why}, the torch path")
    widest = panel_vector_bits() if "avx512f" in cpu_features() else 256
    bits = _VECTORS[vectors] or widest
    if bits > widest:
        raise ValueError(f"invalid cpu_vectors {vectors!r}: this CPU has no AVX-512 (no avx512f in /proc/cpuinfo)")
    rows = panel_row_limit(bits, weight_bytes) if torch.backends.mkldnn.is_available() else 0
    return KernelChoice(True, why, bits, rows)


_installed: KernelChoice | None = None


def install(choice: KernelChoice) -> KernelChoice:
    """Make `choice` this process's, before its model is loaded (a Linear takes its panels when
    packed). A worker installs the one it decided, once: a process holds one worker (a Ray
    actor, or the in-process engine), so the choice is the worker's. Returns `choice`."""
    global _installed
    _installed = choice
    return choice


def installed() -> KernelChoice:
    """The process's choice; where no worker installed one (tests, scripts, training), the
    kernels on, as `decide(True)` finds this CPU."""
    return _installed if _installed is not None else _default()


@cache
def _default() -> KernelChoice:
    return decide(True)


K = TypeVar("K")
V = TypeVar("V")


class PerChoice(Generic[K, V]):
    """What `build` made of each key (a model, a layer's experts) under the installed choice,
    made again where a later one was installed (a test's `using`). Kept beside the keys, weakly,
    not on them: a C++ object cannot be deep-copied with its module."""

    def __init__(self, build: Callable[[K], V]) -> None:
        self._build = build
        self._built: weakref.WeakKeyDictionary[K, tuple[KernelChoice, V]] = weakref.WeakKeyDictionary()

    def get(self, key: K) -> V:
        choice = installed()
        built = self._built.get(key)
        if built is None or built[0] is not choice:
            built = self._built[key] = (choice, self._build(key))
        return built[1]


@contextmanager
def using(choice: KernelChoice | None = None) -> Iterator[KernelChoice]:
    """Tests: `choice` installed for the block (None: the current one, for a block that installs
    its own, as a Worker does), and the process's previous choice back after it."""
    global _installed
    before = _installed
    try:
        yield install(choice) if choice is not None else installed()
    finally:
        _installed = before


def summary(choice: KernelChoice, fallbacks: Sequence[str] = ()) -> str:
    """The worker's start-up line: whether the C++ kernels run and why, which vector path runs
    (AVX-512, AVX2, or AVX2's chosen on an AVX-512 CPU), and panel_linear's row limit with the packed layers it does not read (`fallbacks`: their
    buffers were not the checked layout, so oneDNN runs them at every row count)."""
    if not choice.on:
        return f"CPU kernels off: {choice.why}; panel_linear off"
    if choice.vector_bits == 512:
        vectors = "AVX-512 vectors"
    else:
        vectors = "AVX2 vectors" if "-mavx2" in _cpu_flags() else f"{choice.vector_bits}-bit vectors, no AVX2"
        if "avx512f" in cpu_features():
            vectors += " (--cpu-vectors avx2 on an AVX-512 CPU)"
    if not choice.panel_rows:
        panels = "panel_linear off (no oneDNN packs the weights)"
    elif fallbacks:
        names = ", ".join(fallbacks[:6]) + (f" and {len(fallbacks) - 6} more" if len(fallbacks) > 6 else "")
        panels = (
            f"panel_linear on up to {choice.panel_rows} rows, {len(fallbacks)} packed layer(s) left to oneDNN "
            f"(layout not the checked one): {names}"
        )
    else:
        panels = f"panel_linear on up to {choice.panel_rows} rows, on every packed layer"
    return f"CPU kernels on: {choice.why}, {vectors}; {panels}"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all on the CPU, none needing a gradient (the
    kernels have no backward; training keeps the torch ops), and the installed choice on."""
    if not all(t.device.type == "cpu" for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return installed().on


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Each new token's K and V [N, KVH, D], in the caches' dtype, into slot (blocks[i],
    offsets[i]) of the pages [blocks, block_size, KVH, D]."""
    kernels = load()
    assert kernels is not None, "write_kv called without usable() kernels"
    kernels.write_kv(k_cache, v_cache, k, v, blocks, offsets)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per request, q: [R, H, D], over pages [blocks, block_size, KVH, D] through
    `table` [R, W]; request r sees slots 0..positions[r]. Returns [R, H, D]."""
    kernels = load()
    assert kernels is not None, "paged_decode_attention called without usable() kernels"
    return kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, table, positions, scale)


Spans = tuple[torch.Tensor, torch.Tensor]
"""Which flat tokens each request owns and whether it starts from an empty state:
(starts int64 [R + 1], fresh bool [R]). Without spans each request has one token and continues
the state in its slot (a decode step)."""


def causal_conv(
    conv_cache: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spans: Spans | None = None,
) -> torch.Tensor:
    """The causal depthwise convolution of Mamba2 and Gated DeltaNet over each request's tokens,
    then silu, its state [blocks, C, K - 1] (fp32) advanced in place. x: [N, C] fp32. Returns [N, C]."""
    kernels = load()
    assert kernels is not None, "causal_conv called without usable() kernels"
    starts, fresh = spans if spans is not None else (None, None)
    return kernels.causal_conv(conv_cache, slots, x, weight, bias, starts, fresh)


def mamba_ssm(
    ssm_cache: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float],
    b: torch.Tensor,
    c: torch.Tensor,
    spans: Spans | None = None,
) -> torch.Tensor:
    """The Mamba2 recurrence over each request's tokens in turn, in its state slot [blocks, H, P,
    N] (fp32): `step = max(softplus(dt + dt_bias), dt_min)`, `S = exp(step a) S + step x b^T`,
    `y = S c + D x`. params: (dt_bias, a, D, dt_min); x [N, H, P]; dt [N, H]; b, c [N, G, N],
    all fp32. Returns y [N, H, P]."""
    kernels = load()
    assert kernels is not None, "mamba_ssm called without usable() kernels"
    dt_bias, a, d, dt_min = params
    starts, fresh = spans if spans is not None else (None, None)
    return kernels.mamba_ssm_scan(
        ssm_cache,
        slots,
        x.contiguous(),
        dt.contiguous(),
        dt_bias,
        a,
        d,
        b.contiguous(),
        c.contiguous(),
        dt_min,
        starts,
        fresh,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`F.rms_norm` over the last dim of an fp32 CPU tensor, with or without a weight."""
    kernels = load()
    assert kernels is not None, "rms_norm called without usable() kernels"
    if x.dim() in (2, 3) and x.stride(-1) == 1:
        return kernels.rms_norm(x, weight, eps)
    return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """`weight * rms_norm(x * silu(gate))` per group of `group` channels, in one pass over fp32
    CPU [rows, D] tensors whose rows may be strided."""
    kernels = load()
    assert kernels is not None, "gated_rms_norm called without usable() kernels"
    return kernels.gated_rms_norm(x, gate, weight, group, eps)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """Qwen3's q and k heads x [T, heads, D] (fp32 CPU, D contiguous): each RMS-normalised,
    times its row of `weight` [heads, D], then rotated by the rotary table's `cos` and signed
    `sin` [T, D] (`x * cos + roll(x, D / 2) * sin`), in one pass; bit for bit the torch ops.
    Returns a new [T, heads, D]."""
    kernels = load()
    assert kernels is not None, "qk_norm_rope called without usable() kernels"
    return kernels.qk_norm_rope(x, weight, cos, sin, eps)


def pin_team(cpus: Sequence[int]) -> tuple[int, ...]:
    """Bind the calling thread's OpenMP team one thread a CPU: thread i to `cpus[i]`, the
    caller being thread 0 (docs/design.md §13). Returns the CPUs bound, by thread; empty where
    they were not (no kernels, a team of another size than `cpus`, not Linux), the team then
    keeping the binding it had."""
    kernels = load()
    return () if kernels is None else tuple(kernels.pin_team(list(cpus)))


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int, vector_bits: int = 0
) -> torch.Tensor:
    """`x @ W.T + bias` for fp32 CPU rows x [..., in], W held as `panels` [blocks, kp, nb] (see
    `kernels.cpu.onednn_panels`); for a few rows, where it outruns oneDNN on the same buffer.
    `vector_bits` (256 or 512) picks the kernel's vector width; 0 takes the widest this CPU has."""
    kernels = load()
    assert kernels is not None, "panel_linear called without usable() kernels"
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    bits = vector_bits or panel_vector_bits()
    return kernels.panel_linear(rows, panels, bias, out_features, bits).view(*x.shape[:-1], out_features)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    chunks: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    vector_bits: int = 0,
) -> None:
    """Causal attention of a step's prompt chunks, read from the pages (fp32 CPU). Request r
    (row r of `table` [R, W] and of `chunks` [R, 3], both int64) has rows start..start + len of
    q [N, H, D] (each token's heads contiguous, D a multiple of 64), at positions pos.. (its
    tokens cached before); `chunks[r]` is (start, len, pos). A query at position p sees its
    request's keys and values 0..p, and the last block of a chunk's queries also every slot to
    the end of its last page, with weight 0, so that a NaN left there reaches its output
    (docs/design.md §13). Writes those rows of `out` (contiguous [N, H, D]), the others left as
    they are. `vector_bits` as for `panel_linear`."""
    kernels = load()
    assert kernels is not None, "prefill_attention called without usable() kernels"
    kernels.prefill_attention(q, k_cache, v_cache, table, chunks, out, scale, vector_bits or panel_vector_bits())


@cache
def panel_vector_bits() -> int:
    """The widest vectors `panel_linear` has on this CPU: 512 (AVX-512) or 256 bits."""
    kernels = load()
    assert kernels is not None, "panel_vector_bits called without usable() kernels"
    return int(kernels.panel_vector_bits())


def panel_row_limit(vector_bits: int = 0, weight_bytes: int = 0, vendor: str | None = None) -> int:
    """Up to how many rows `panel_linear` at `vector_bits` (0: this CPU's widest) beats oneDNN
    for a model whose weights take `weight_bytes` (0: a small one) on a CPU of `vendor` (None:
    this one's) (docs/design.md §13). With AVX2, against oneDNN capped to AVX2, 1.2-1.5x at one
    to sixteen rows, weights streamed from memory, on one core and two. With AVX-512 it depends
    on where the weights come from and on the CPU: a bench model's (within the last-level
    cache) decode steps of 4 and 8 rows ran 1.2-1.3x faster on 2 threads; with a real-size
    model's streamed from memory, the kernel only matched oneDNN at one and two rows on an
    Intel Xeon, where a 4-row step ran 1.6x slower, but on an AMD EPYC (Zen 4) it beat oneDNN
    at three to six rows (1.2x at four), one group of rows sharing one pass over the stream,
    and from seven (two groups) it only matches it."""
    if (vector_bits or panel_vector_bits()) != 512:
        return 16
    if weight_bytes <= last_level_cache_bytes():
        return 8
    return 6 if (cpu_vendor() if vendor is None else vendor) == "AuthenticAMD" else 2


@cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs lists for CPU 0 (its L3, shared), or 32 MiB where none is
    listed: whether a model's weights can stay in cache from one decode step to the next."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


if __name__ == "__main__":
    if load() is None:
        raise SystemExit("the CPU kernels did not build (see the warning above)")
    print(f"CPU kernels built in {_build_dir()}")
