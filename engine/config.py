"""The engine/server configuration: one validated, frozen dataclass every layer shares.

It lives here, below `api` and `serve`, because the engine, its workers and the API server all
read it; `serve/config.py` builds it from the YAML file, `RAYPD_*` variables and CLI flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from actors.process import parse_cpus, rank_cpus

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
FailurePolicy = Literal["recompute", "fail"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
RouterPolicy = Literal["round_robin", "least_loaded", "cache_aware"]
CpuVectors = Literal["auto", "avx2", "avx512"]

DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "tiny-hybrid")
MiB = 1 << 20
MAX_TP = 64
# A CPU prefill engine's default step budget (Config.step_token_budget).
CPU_PREFILL_STEP_TOKENS = 256


Role = Literal["colocated", "prefill", "decode"]


class ConfigError(ValueError):
    """A configuration raypd cannot run with; `field` names the field to blame, if one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _f(
    default: Any,
    doc: str,
    *,
    lo: int | None = None,
    hi: int | None = None,
    size: bool = False,
    secret: bool = False,
    listed: bool = False,
) -> Any:
    """A field that carries its CLI help and checks, so each knob is described in one place.
    `listed`: a comma-separated list, whose flag may also be repeated."""
    meta = {"doc": doc, "lo": lo, "hi": hi, "size": size, "secret": secret, "listed": listed}
    # A secret stays out of repr() so that logging the config cannot leak it.
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


@dataclass(frozen=True, slots=True)
class Config:
    """Everything an engine, its workers and the API server need to start."""

    model: str = _f(DEFAULT_MODEL, "model directory (config.json, safetensors, tokenizer.json)")
    served_model_name: str | None = _f(None, "model name in the API; default: the model directory's name")
    dtype: Dtype = _f("auto", "weight and activation dtype; auto = the checkpoint's (fp32 on CPU)")
    kv_cache_dtype: Dtype = _f("auto", "KV cache dtype; auto = the model's dtype")
    device: Device = _f("auto", "auto = cuda if available, else cpu")
    cpu_kernels: bool = _f(True, "on a CPU, the C++ kernels (docs/design.md §13); off: the torch path")
    cpu_vectors: CpuVectors = _f(
        "auto",
        "the C++ kernels' vector path: auto = the widest this CPU has; avx2 = the 256-bit path an AVX2-only "
        "CPU runs, on any CPU (to measure or test it); avx512 = refused where the CPU lacks it",
    )
    block_size: int | None = _f(None, "tokens per KV block; default: chosen for the model", lo=1)
    num_kv_blocks: int | None = _f(None, "KV blocks per engine; default: from kv_cache_memory", lo=1)
    kv_cache_memory: int = _f(256 * MiB, "KV cache bytes per engine: 1000000, 512MiB, 1GiB", lo=1, size=True)
    max_num_batched_tokens: int = _f(2048, "token budget of one scheduler step", lo=1)
    prefill_max_num_batched_tokens: int | None = _f(
        None,
        "PD: token budget of a prefill engine's step; default: on a CPU, 256 (max_num_seqs if more, "
        "max_num_batched_tokens if less), so a burst's first prompts come back a step sooner; elsewhere "
        "max_num_batched_tokens",
        lo=1,
    )
    max_num_seqs: int = _f(64, "most requests running at once in one engine", lo=1)
    max_model_len: int | None = _f(None, "longest prompt + output; default: the model's limit", lo=1)
    max_waiting: int = _f(1024, "bound of the waiting queue; beyond it the API answers 503", lo=1)
    max_inflight: int | None = _f(
        None,
        "engine requests (choices) the API server works on at once; beyond it 503; "
        "default: what the engines hold, decode x (max_num_seqs + max_waiting)",
        lo=1,
    )
    async_scheduling: bool = _f(True, "schedule step N+1 while step N runs")
    prefill_hold_ms: int = _f(
        100,
        "async scheduling: plan no step behind one whose prompt tokens are expected to take this long, "
        "so requests arriving meanwhile join the next step (docs/design.md §3)",
        lo=0,
    )
    enable_prefix_caching: bool = _f(
        True,
        "reuse the KV blocks of shared prompt prefixes; a hybrid model's hit also needs a state "
        "checkpoint at the hit (docs/design.md §21)",
    )
    prefix_cache_checkpoint_interval: int = _f(
        4, "hybrid models: keep the state after every N-th block (and after each prompt's last full block)", lo=1
    )
    prefix_cache_checkpoint_pages: int | None = _f(
        None,
        "hybrid models: KV pages running requests may hold as state checkpoints; default: a quarter of the pool",
        lo=0,
    )
    router: RouterPolicy = _f(
        "cache_aware",
        "how the API picks an engine of each role: in turn, by load, or by cached prefix against load "
        "(docs/design.md §22)",
    )
    pd_min_prefill_tokens: int = _f(
        0,
        "PD: a prompt with fewer tokens than this not cached on its decode engine is computed there, "
        "with no KV transfer (so is any prompt while every prefill engine is saturated); 0 = always transfer",
        lo=0,
    )
    seed: int = _f(0, "random seed for sampling", lo=0)
    host: str = _f("127.0.0.1", "address the API server binds")
    port: int = _f(8000, "port the API server listens on", lo=1, hi=65535)
    api_key: str | None = _f(
        None,
        "bearer token(s) the API accepts: a comma-separated list, or the flag repeated; default: no auth",
        secret=True,
        listed=True,
    )
    prefill: int = _f(
        0,
        "number of prefill engines; 0 = prefill and decode colocated (1 when --prefill-tp/--decode-tp is given)",
        lo=0,
    )
    decode: int = _f(1, "number of decode (or colocated) engines", lo=1)
    min_prefill: int | None = _f(None, "fewest prefill engines the autoscaler keeps; default: --prefill", lo=1)
    max_prefill: int | None = _f(None, "most prefill engines the autoscaler starts; default: --prefill", lo=1)
    min_decode: int | None = _f(
        None, "fewest decode (or colocated) engines the autoscaler keeps; default: --decode", lo=1
    )
    max_decode: int | None = _f(
        None, "most decode (or colocated) engines the autoscaler starts; default: --decode", lo=1
    )
    scale_prefill_waiting: int = _f(4, "autoscaling target: requests waiting per prefill engine", lo=1)
    scale_prefill_ttft_ms: int = _f(
        2000, "autoscaling target: a prefill engine's mean time to first token (queue and prefill), ms", lo=1
    )
    scale_decode_itl_ms: int = _f(200, "autoscaling target: a busy decode engine's mean time per step, ms", lo=1)
    scale_decode_kv_percent: int = _f(
        80, "autoscaling target: percent of a decode engine's KV blocks in use", lo=1, hi=100
    )
    scale_up_delay_s: int = _f(10, "seconds a role stays above a target before an engine is added", lo=0)
    scale_down_delay_s: int = _f(
        60, "seconds a role stays below half of every target before an engine is drained", lo=0
    )
    drain_timeout_s: int = _f(
        120, "seconds a drained engine's requests may take to finish; the rest resume on other engines", lo=1
    )
    api_replicas: int = _f(1, "API ingress replicas (Ray Serve); every one routes to every engine", lo=1)
    tensor_parallel_size: int = _f(1, "worker actors (tensor-parallel ranks) per engine", lo=1, hi=MAX_TP)
    prefill_tp: int | None = _f(None, "tensor-parallel ranks per prefill engine; default: -tp", lo=1, hi=MAX_TP)
    decode_tp: int | None = _f(None, "tensor-parallel ranks per decode engine; default: -tp", lo=1, hi=MAX_TP)
    worker_threads: int | None = _f(None, "torch threads per worker actor; default: torch's", lo=1)
    worker_cpus: str | None = _f(
        None,
        "CPUs the workers compute on, as a list like 0-3,8 (a TP engine's ranks share it out); the "
        "engine and API processes keep to the other CPUs. Default: nothing is bound",
    )
    prefill_worker_cpus: str | None = _f(
        None,
        "CPUs the prefill engines' workers compute on (a list like --worker-cpus), so that prefill and "
        "decode on one host each keep to their own cores; not with --worker-cpus nor colocated engines",
    )
    decode_worker_cpus: str | None = _f(
        None,
        "CPUs the decode engines' workers compute on (a list like --worker-cpus); not with --worker-cpus "
        "nor colocated engines",
    )
    address: str | None = _f(
        None, "Ray cluster address; default: RAY_ADDRESS (set in a Ray job), else start a local cluster"
    )
    ray_dashboard: bool = _f(
        False,
        "start Ray's dashboard with the local cluster raypd starts (no --address); off by default: its "
        "processes take ~6% of a core while idle, from the forward's cores on a small machine",
    )
    detach: bool = _f(
        False,
        "leave the service running when this process exits (needs a cluster: --address or a Ray job); `--stop` ends it",
    )
    kv_load_failure_policy: FailurePolicy = _f(
        "recompute", "a failed KV load: recompute the prompt, or fail the request"
    )
    migration_timeout_s: int = _f(
        30, "seconds a request whose engine died may spend resuming on another one; 0 = fail it", lo=0
    )
    kv_lease_s: int = _f(
        10, "seconds a prefill engine keeps a request's KV unread; the decode side renews it while waiting", lo=1
    )
    kv_verify: bool = _f(
        False,
        "checksum each handed-over KV page (prefill) and check it after the READ (decode); a mismatch fails the load",
    )
    kv_transfer_timeout_s: int = _f(30, "seconds a KV READ may take; then it fails (the failure policy applies)", lo=1)
    debug_zero_loaded_blocks: bool = _f(False, "DEBUG: zero blocks a remote KV load fills (reintroduces the race)")
    debug_kv_fail_percent: int = _f(0, "TESTS: percent of KV loads made to fail", lo=0, hi=100)
    debug_kv_delay_ms: int = _f(
        0, "TESTS: hold each KV READ back this long; past --kv-transfer-timeout-s it hangs", lo=0
    )
    debug_kv_corrupt_percent: int = _f(
        0, "TESTS: percent of landed KV loads whose first block is corrupted (caught by --kv-verify)", lo=0, hi=100
    )
    debug_stream_delay_ms: int = _f(0, "TESTS: delay before each compute-stream job, to make it lag", lo=0)
    log_level: LogLevel = _f("INFO", "logging level")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check(field, getattr(self, field.name))
        if any(not k or any(c.isspace() for c in k) for k in self.api_keys):
            # The value is a secret: the message must not quote it.
            raise ConfigError("invalid api_key: each comma-separated key must be non-empty, without spaces", "api_key")
        # As in vLLM: every running request must be able to get a token in every step.
        for name in ("max_num_batched_tokens", "prefill_max_num_batched_tokens"):
            budget = getattr(self, name)
            if budget is not None and budget < self.max_num_seqs:
                raise ConfigError(f"invalid {name} {budget}: must be >= max_num_seqs ({self.max_num_seqs})", name)
        if self.prefill == 0 and (self.prefill_tp is not None or self.decode_tp is not None):
            # Sizing prefill and decode engines asks for them: one prefill engine unless told more.
            object.__setattr__(self, "prefill", 1)
        self._check_scaling()
        self._check_cpus()

    def _check_cpus(self) -> None:
        """Each CPU list parses and has a CPU for every TP rank of the engines it binds; the
        per-role lists replace `worker_cpus` in a PD layout (no precedence to guess)."""
        for role in ("prefill", "decode"):
            name = f"{role}_worker_cpus"
            value = getattr(self, name)
            if not value:
                continue
            if self.worker_cpus:
                raise ConfigError(
                    f"invalid {name} {value!r}: give either worker_cpus ({self.worker_cpus!r}) for every "
                    "engine or the per-role lists, not both",
                    name,
                )
            if self.colocated:
                raise ConfigError(
                    f"invalid {name} {value!r}: colocated engines (--prefill 0) have no {role} role; use worker_cpus",
                    name,
                )
        binds: dict[str, tuple[Role, ...]] = {
            "worker_cpus": ("colocated",) if self.colocated else ("prefill", "decode"),
            "prefill_worker_cpus": ("prefill",),
            "decode_worker_cpus": ("decode",),
        }
        for name, roles in binds.items():
            value = getattr(self, name)
            if not value:
                continue
            try:
                cpus = parse_cpus(value)
                for role in roles:
                    rank_cpus(cpus, 0, self.tp_size(role))
            except ValueError as e:
                raise ConfigError(f"invalid {name} {value!r}: {e}", name) from None

    def _check_scaling(self) -> None:
        if self.colocated:
            for name in ("min_prefill", "max_prefill"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"invalid {name} {getattr(self, name)}: colocated engines (--prefill 0) have no prefill side",
                        name,
                    )
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            count = getattr(self, role)
            if lo is not None and lo > count:
                raise ConfigError(
                    f"invalid min_{role} {lo}: more than the {count} {role} engines started (--{role})", f"min_{role}"
                )
            if hi is not None and hi < count:
                raise ConfigError(
                    f"invalid max_{role} {hi}: fewer than the {count} {role} engines started (--{role})", f"max_{role}"
                )

    def engine_range(self, role: str) -> tuple[int, int]:
        """The fewest and most engines of `role` ("prefill", or "decode" for colocated ones too)
        the autoscaler may run; equal to the started count when it is not told a range."""
        count = getattr(self, role)
        lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
        return (count if lo is None else lo, count if hi is None else hi)

    @property
    def autoscaling(self) -> bool:
        """Whether any role's engine count may change."""
        roles = ("decode",) if self.colocated else ("prefill", "decode")
        return any(self.engine_range(r)[0] != self.engine_range(r)[1] for r in roles)

    @property
    def model_name(self) -> str:
        """The name clients use in requests."""
        return self.served_model_name or Path(self.model).name

    def role_cpus(self, role: Role) -> tuple[int, ...]:
        """The CPUs the workers of an engine of `role` compute on: its role's list, else
        `worker_cpus`; none when neither is set."""
        own = {"prefill": self.prefill_worker_cpus, "decode": self.decode_worker_cpus}.get(role)
        text = own or self.worker_cpus
        return parse_cpus(text) if text else ()

    @property
    def bound_cpus(self) -> tuple[int, ...]:
        """Every CPU some worker is bound to: the engine and API processes keep off them."""
        lists = (self.worker_cpus, self.prefill_worker_cpus, self.decode_worker_cpus)
        return tuple(sorted({cpu for text in lists if text for cpu in parse_cpus(text)}))

    @property
    def colocated(self) -> bool:
        """True when each engine does both prefill and decode."""
        return self.prefill == 0

    def step_token_budget(self, role: Role, device: str) -> int:
        """The token budget of one step of an engine of `role` whose worker computes on `device`.

        A prefill engine's steps are prompts alone. On a CPU a step of 256 prompt tokens already
        multiplies at the matmul's full rate, so a burst of prompts taken a few at a time costs
        no more in all than taken at once, and the first of them come back after one short step
        instead of after the whole burst (BENCHMARKS.md, `bench.peers_pd`). A GPU needs far
        bigger steps to be busy: it keeps `max_num_batched_tokens`."""
        if role != "prefill":
            return self.max_num_batched_tokens
        if self.prefill_max_num_batched_tokens is not None:
            return self.prefill_max_num_batched_tokens
        if device != "cpu":
            return self.max_num_batched_tokens
        return min(self.max_num_batched_tokens, max(CPU_PREFILL_STEP_TOKENS, self.max_num_seqs))

    def tp_size(self, role: Role) -> int:
        """The tensor-parallel ranks of an engine of `role`."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return own or self.tensor_parallel_size

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted bearer tokens; none means the API is open."""
        return tuple(k.strip() for k in self.api_key.split(",")) if self.api_key else ()

    @property
    def inflight_limit(self) -> int:
        """`max_inflight`, or what the most decode (or colocated) engines can hold running and waiting."""
        if self.max_inflight is not None:
            return self.max_inflight
        return self.engine_range("decode")[1] * (self.max_num_seqs + self.max_waiting)

    def describe(self) -> str:
        """Every field as `name = value`, one a line, secrets masked: printed at start-up."""
        fields = dataclasses.fields(self)
        width = max(len(f.name) for f in fields)
        return "\n".join(f"{f.name:<{width}} = {show_value(f, getattr(self, f.name))}" for f in fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so the config can be sent to Ray actors and rebuilt there."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """The inverse of `to_dict`, validated again on the receiving side."""
        for key in data:
            if key not in FIELDS:
                raise ConfigError(unknown_name(f"unknown config field {key!r}", key, FIELDS))
        return cls(**data)


@dataclass(frozen=True, slots=True)
class _Spec:
    """A field's type reduced to what parsing and checking need."""

    kind: type  # bool, int or str
    optional: bool
    choices: tuple[str, ...]


def _spec(annotation: Any) -> _Spec:
    args = typing.get_args(annotation)
    optional = isinstance(annotation, types.UnionType) and type(None) in args
    if optional:
        (annotation,) = (a for a in args if a is not type(None))
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()
    return _Spec(str if choices else annotation, optional, choices)


SPECS: dict[str, _Spec] = {name: _spec(tp) for name, tp in typing.get_type_hints(Config).items()}
FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}


def _check(field: dataclasses.Field[Any], value: Any) -> None:
    """Raise ConfigError unless `value` is valid for `field`."""
    name, spec, meta = field.name, SPECS[field.name], field.metadata

    def bad(why: str) -> ConfigError:
        shown = "***" if meta["secret"] else repr(value)  # a secret never goes into an error or a log
        return ConfigError(f"invalid {name} {shown}: {why}", name)

    if value is None:
        if not spec.optional:
            raise bad("a value is required")
        return
    if spec.choices:
        if value not in spec.choices:
            raise bad(f"must be one of {', '.join(spec.choices)}")
    elif spec.kind is bool:
        if not isinstance(value, bool):
            raise bad("must be true or false")
    elif spec.kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("must be an integer")
        lo, hi = meta["lo"], meta["hi"]
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise bad(f"must be in {lo}..{hi}" if hi is not None else f"must be >= {lo}")
    elif not isinstance(value, str) or not value.strip():
        raise bad("must be a non-empty string")


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?", re.IGNORECASE)
_UNITS = "kmgt"


def parse_size(text: str) -> int:
    """Bytes in `text`: a plain count or a number with a unit. KiB..TiB are powers of 1024, KB..TB (or
    K..T) powers of 1000, as the IEC and SI prefixes say, so each spelling has exactly one meaning."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError("expected a byte count such as 1000000, 512MiB or 1GiB")
    number, unit, binary = match.groups()
    power = _UNITS.index(unit.lower()) + 1 if unit else 0
    size = Fraction(number) * (1024 if binary else 1000) ** power
    if size.denominator != 1:
        raise ValueError("not a whole number of bytes")
    return int(size)


def format_size(size: int) -> str:
    """`size` in the largest binary unit that divides it, in a form `parse_size` reads back."""
    for power in range(len(_UNITS), 0, -1):
        if size % 1024**power == 0:
            return f"{size // 1024**power}{_UNITS[power - 1].upper()}iB"
    return str(size)


def show_value(field: dataclasses.Field[Any], value: Any) -> str:
    if value is not None and field.metadata["secret"]:
        return "***"
    return format_size(value) if field.metadata["size"] else str(value)


def unknown_name(message: str, key: str, known: Iterable[str]) -> str:
    """`message`, with the closest known name suggested when there is one."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message
