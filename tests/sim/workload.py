"""Workload shapes and the seeded requests of one run.

A shape fixes the model's cache groups, the engines' pools and scheduling knobs, and the
faults (failed loads, aborts, short leases); a seed draws the requests: prompts (with
shared prefixes and exact duplicates when asked, so a decode engine's prefix cache hits),
output lengths, arrival times and where each client leaves.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Literal

from kv.cache_group import CacheGroup
from tests.sim.fabric import TransferTiming

BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
TOKEN_RANGE = (2, 50)  # within tests.engine.fake_worker.VOCAB
# A sampled EOS ends a request before max_tokens, which the scheduler cannot foresee: under
# async scheduling a step for its next token is then already in flight.
EOS = 7

GROUPS = {
    "hybrid": (CacheGroup("attention", (1,)), CacheGroup("mamba", (0,))),
    "dense": (CacheGroup("attention", (0,)),),
    # Three attention layers per Mamba layer: groups of one layer each (kv/cache_layout.py).
    "hybrid_3to1": (
        CacheGroup("attention", (1,)),
        CacheGroup("attention", (2,)),
        CacheGroup("attention", (3,)),
        CacheGroup("mamba", (0,)),
    ),
}

AbortPoint = Literal["before_prefill", "between", "queued", "mid_load", "mid_decode"]
ABORT_POINTS: tuple[AbortPoint, ...] = ("before_prefill", "between", "queued", "mid_load", "mid_decode")


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    model: Literal["hybrid", "dense", "hybrid_3to1"]
    pd: bool = True
    prefix_caching: bool = False
    checkpoint_interval: int = 1  # blocks between a hybrid's state checkpoints (docs/design.md §21)
    async_scheduling: bool = True
    # EngineCore's prefill_hold_s (docs/design.md §3): 0.0 waits behind every prompt step
    prefill_hold_s: float | None = None
    prefill_blocks: int = 64
    decode_blocks: int = 64
    max_num_seqs: int = 8
    max_batched_tokens: int = 32
    # A prefill engine's own step budget (engine/config.py `step_token_budget`); None = the above.
    prefill_max_batched_tokens: int | None = None
    num_requests: int = 16
    prompt_len: tuple[int, int] = (1, 24)  # 1: the prefill engine hands over an empty prompt
    max_tokens: tuple[int, int] = (1, 10)
    shared_prefixes: int = 0  # distinct block-aligned prefixes prompts start with; 0 = none
    duplicate_fraction: float = 0.0  # prompts that repeat an earlier one exactly
    arrival_gap_s: float = 0.002  # mean gap between arrivals (virtual seconds); 0 = one burst
    burst_size: int = 0  # > 0: requests come in bursts of this many, `burst_gap_s` apart
    burst_gap_s: float = 0.2
    fail_fraction: float = 0.0
    policy: Literal["recompute", "fail"] = "recompute"
    abort_fraction: float = 0.0
    abort_points: tuple[AbortPoint, ...] = ABORT_POINTS
    lease_s: float = 30.0
    lag_s: tuple[float, float] = (0.0002, 0.002)  # per compute-stream job
    prefill_tp: int = 1  # tensor-parallel ranks per engine (tests/sim/ranks.py)
    decode_tp: int = 1  # also the colocated engine's
    timing: TransferTiming = field(default_factory=TransferTiming)

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        return GROUPS[self.model]

    def max_total_tokens(self) -> int:
        """The longest prompt + max_tokens every engine's pool accepts (Scheduler.check_length)."""
        attn = sum(g.kind == "attention" for g in self.groups)
        pool = min(self.prefill_blocks, self.decode_blocks) if self.pd else self.decode_blocks
        return (pool - len(self.groups)) // attn * BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class Abort:
    point: AbortPoint
    # before_prefill: after submitting; queued: after the decode engine took the request;
    # mid_load: after the decode worker posted the READ
    delay_s: float = 0.0
    after_tokens: int = 0  # mid_decode: how many tokens it reads first


@dataclass(frozen=True, slots=True)
class RequestSpec:
    req_id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float
    abort: Abort | None = None


def make_requests(shape: Shape, seed: int) -> list[RequestSpec]:
    rng = random.Random(f"{shape.name}/{seed}/workload")
    limit = shape.max_total_tokens()
    prefixes = [_tokens(rng, BLOCK_SIZE * rng.randint(1, 3)) for _ in range(shape.shared_prefixes)]
    specs: list[RequestSpec] = []
    t = 0.0
    for i in range(shape.num_requests):
        max_tokens = rng.randint(*shape.max_tokens)
        earlier = [s.prompt for s in specs if len(s.prompt) + max_tokens <= limit]
        if earlier and rng.random() < shape.duplicate_fraction:
            prompt = list(rng.choice(earlier))
        else:
            prompt = _prompt(rng, shape, prefixes, limit - max_tokens)
        if shape.burst_size and i and i % shape.burst_size == 0:
            t += shape.burst_gap_s  # the engines go idle in between: each gap is an idle check
        elif shape.arrival_gap_s > 0:
            t += rng.expovariate(1 / shape.arrival_gap_s)
        abort = _abort(rng, shape, max_tokens) if rng.random() < shape.abort_fraction else None
        specs.append(RequestSpec(f"r{i}", prompt, max_tokens, t, abort))
    return specs


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(n)]


def _prompt(rng: random.Random, shape: Shape, prefixes: list[list[int]], room: int) -> list[int]:
    lo, hi = shape.prompt_len
    n = rng.randint(lo, min(hi, room))
    if shape.pd and rng.random() < 0.5:
        # N - 1 block aligned: the prefill side hands over whole blocks, and a local prefix
        # hit can then cover the whole grant.
        n = max(BLOCK_SIZE + 1, (n - 1) // BLOCK_SIZE * BLOCK_SIZE + 1)
    head = list(rng.choice(prefixes)) if prefixes else []
    head = head[: max(n - 1, 0)]
    return head + _tokens(rng, n - len(head))


def _abort(rng: random.Random, shape: Shape, max_tokens: int) -> Abort:
    point = rng.choice(shape.abort_points)
    if point == "mid_decode":
        return Abort(point, after_tokens=rng.randint(1, max(1, max_tokens - 1)))
    # mid_load: as long as the latest landing, or (half the time) within the first few steps,
    # so a client also leaves just after its load failed and before it was computed again.
    longest = 0.03 if point == "mid_load" and rng.random() < 0.5 else 0.004
    return Abort(point, delay_s=rng.uniform(0.0, longest))


# The decode side refuses a READ within `LEASE_MARGIN_S` (0.25 s) of the lease's end: a 0.3 s
# lease leaves a 50 ms window, shorter than a long queue's wait and than the slowest READs.
LEASE_S = 0.3
SLOW_READS = TransferTiming(p_late=0.3, late_s=(0.02, 0.5))

SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("hybrid_pd", "hybrid"),
        Shape(
            "hybrid_pd_tight",
            "hybrid",
            decode_blocks=14,
            prefill_blocks=20,
            num_requests=24,
            arrival_gap_s=0.0,
            max_num_seqs=6,
        ),
        Shape(
            "hybrid_pd_tight_sync",
            "hybrid",
            async_scheduling=False,
            decode_blocks=12,
            prefill_blocks=16,
            num_requests=20,
            arrival_gap_s=0.0005,
        ),
        Shape(
            "dense_pd_prefix",
            "dense",
            prefix_caching=True,
            decode_blocks=16,
            prefill_blocks=24,
            num_requests=24,
            shared_prefixes=3,
            duplicate_fraction=0.3,
            arrival_gap_s=0.001,
        ),
        Shape(
            "dense_pd_prefix_sync_aborts",
            "dense",
            prefix_caching=True,
            async_scheduling=False,
            abort_fraction=0.3,
            decode_blocks=16,
            prefill_blocks=20,
            shared_prefixes=3,
            duplicate_fraction=0.3,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        Shape("hybrid_pd_fail_recompute", "hybrid", fail_fraction=0.2, decode_blocks=20, num_requests=20),
        Shape(
            "hybrid_pd_tight_hold_fail_aborts",
            "hybrid",
            prefill_hold_s=0.0,
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=14,
            prefill_blocks=20,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        Shape(
            "dense_pd_prefix_hold_fail_aborts",
            "dense",
            prefill_hold_s=0.0,
            prefix_caching=True,
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=16,
            prefill_blocks=20,
            shared_prefixes=3,
            duplicate_fraction=0.3,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        Shape(
            "hybrid_colocated_tight_hold_aborts",
            "hybrid",
            pd=False,
            prefill_hold_s=0.0,
            abort_fraction=0.3,
            decode_blocks=14,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        Shape(
            "dense_pd_prefix_fail_recompute",
            "dense",
            prefix_caching=True,
            fail_fraction=0.2,
            decode_blocks=20,
            shared_prefixes=2,
            duplicate_fraction=0.2,
            num_requests=20,
        ),
        Shape(
            "hybrid_pd_fail_policy_aborts",
            "hybrid",
            fail_fraction=0.2,
            policy="fail",
            abort_fraction=0.3,
            decode_blocks=24,
            num_requests=20,
        ),
        Shape(
            "dense_pd_fail_policy_aborts",
            "dense",
            fail_fraction=0.2,
            policy="fail",
            abort_fraction=0.3,
            decode_blocks=24,
            num_requests=20,
        ),
        Shape(
            "hybrid_pd_aborts_tight",
            "hybrid",
            abort_fraction=0.4,
            decode_blocks=14,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        Shape(
            "hybrid_pd_recompute_aborts",
            "hybrid",
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=18,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        # Small bursts with idle gaps: a client that leaves after its load failed may leave the
        # engine idle with the request's blocks fenced on a step that is never scheduled.
        Shape(
            "dense_pd_fail_recompute_leave_bursts",
            "dense",
            fail_fraction=0.5,
            abort_fraction=0.9,
            abort_points=("mid_load",),
            max_num_seqs=2,
            max_tokens=(1, 1),
            num_requests=64,
            arrival_gap_s=0.001,
            burst_size=4,
        ),
        # Leases shorter than the decode queue's wait and than some READs: the prefill engine frees
        # and reuses pages that a decode request has not read yet, or is still reading.
        Shape(
            "hybrid_pd_lease_queue",
            "hybrid",
            lease_s=LEASE_S,
            timing=SLOW_READS,
            max_num_seqs=2,
            prefill_blocks=16,
            decode_blocks=30,
            num_requests=24,
            arrival_gap_s=0.0,
        ),
        Shape(
            "dense_pd_prefix_lease_queue_fail_policy",
            "dense",
            prefix_caching=True,
            lease_s=LEASE_S,
            timing=SLOW_READS,
            policy="fail",
            max_num_seqs=2,
            prefill_blocks=16,
            decode_blocks=30,
            shared_prefixes=2,
            duplicate_fraction=0.2,
            num_requests=24,
            arrival_gap_s=0.0,
        ),
        Shape(
            "hybrid_3to1_pd_tight_fail_aborts",
            "hybrid_3to1",
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=40,
            prefill_blocks=48,
            num_requests=24,
            arrival_gap_s=0.0005,
        ),
        # A prefill engine whose steps are smaller than the prompts (a CPU's default, docs/design.md
        # §3): bursts are chunked across its steps while loads fail and requests are aborted.
        Shape(
            "hybrid_pd_small_prefill_steps_fail_aborts",
            "hybrid",
            prefill_max_batched_tokens=8,
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=14,
            prefill_blocks=20,
            num_requests=24,
            burst_size=8,
        ),
        Shape(
            "dense_pd_prefix_small_prefill_steps_fail_aborts",
            "dense",
            prefix_caching=True,
            prefill_max_batched_tokens=8,
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=16,
            prefill_blocks=24,
            shared_prefixes=2,
            num_requests=24,
            burst_size=8,
        ),
        Shape("hybrid_colocated_tight", "hybrid", pd=False, decode_blocks=12, num_requests=24, arrival_gap_s=0.0),
        # Hybrid prefix caching (docs/design.md §21): state checkpoints at block boundaries, hits
        # that restore one, a decode engine's local hit plus a remote load of the rest.
        Shape(
            "hybrid_colocated_prefix_tight",
            "hybrid",
            pd=False,
            prefix_caching=True,
            decode_blocks=16,
            shared_prefixes=3,
            duplicate_fraction=0.3,
            num_requests=24,
            arrival_gap_s=0.001,
        ),
        Shape(
            "hybrid_pd_prefix",
            "hybrid",
            prefix_caching=True,
            decode_blocks=32,
            prefill_blocks=32,
            shared_prefixes=3,
            duplicate_fraction=0.3,
            max_tokens=(1, 14),
            num_requests=24,
            arrival_gap_s=0.002,
        ),
        Shape(
            "hybrid_pd_prefix_fail_aborts_tight",
            "hybrid",
            prefix_caching=True,
            fail_fraction=0.2,
            abort_fraction=0.3,
            decode_blocks=18,
            prefill_blocks=24,
            shared_prefixes=3,
            duplicate_fraction=0.3,
            num_requests=24,
            arrival_gap_s=0.001,
        ),
        Shape(
            "hybrid_3to1_pd_prefix_sync",
            "hybrid_3to1",
            prefix_caching=True,
            async_scheduling=False,
            fail_fraction=0.1,
            checkpoint_interval=2,
            decode_blocks=48,
            prefill_blocks=48,
            shared_prefixes=2,
            duplicate_fraction=0.3,
            num_requests=20,
        ),
    )
}

# Tensor parallelism (tests/sim/ranks.py): each rank's pages hold its own heads; loads fail
# and land per rank; prefill TP above, below and equal to decode TP.
for _base, _p, _d in (
    ("hybrid_pd_recompute_aborts", 2, 1),
    ("hybrid_pd_recompute_aborts", 1, 2),
    ("hybrid_pd_tight", 2, 2),
    ("dense_pd_prefix_fail_recompute", 1, 2),
    ("hybrid_colocated_tight", 1, 2),
    ("hybrid_pd_prefix_fail_aborts_tight", 2, 1),
    ("hybrid_pd_prefix_fail_aborts_tight", 1, 2),
    ("hybrid_pd_prefix_fail_aborts_tight", 2, 2),
):
    _tp = dataclasses.replace(SHAPES[_base], name=f"{_base}_tp{_p}{_d}", prefill_tp=_p, decode_tp=_d)
    SHAPES[_tp.name] = _tp
