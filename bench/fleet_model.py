"""A model of one engine for the fleet simulation: a step loop on a virtual clock, an LRU prefix
cache of block digests, and the summary a real engine gives the routers (engine/summary.py).

Each step spends up to `batch_tokens`: one token per running request, the rest on waiting
prompts in arrival order (chunked); it lasts `step_base_s + step_token_s * tokens`. A prompt
finds the longest run of its leading blocks that the engine really holds when it is admitted
(which may be less than the router guessed from an older summary) and computes the rest; its
blocks are cached when it is computed, evicting the least recently used ones beyond `num_blocks`.
The costs are set in `EngineCosts` (bench/fleet_sim.py prints them with its table).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.routing.prefix import PromptBlocks
from engine.summary import EngineSummary


@dataclass(frozen=True, slots=True)
class EngineCosts:
    block_size: int = 16
    num_blocks: int = 2048
    batch_tokens: int = 2048
    max_running: int = 64
    step_base_s: float = 0.005
    step_token_s: float = 0.00004
    transfer_base_s: float = 0.001
    transfer_token_s: float = 0.000002


@dataclass(slots=True)
class Job:
    """One request on one engine: prompt tokens left to compute, then (decode side) tokens to emit."""

    req: Any  # the simulation's record of the request, handed back through the callbacks
    prompt: PromptBlocks
    to_compute: int
    outputs_left: int  # 0 on a prefill engine: it hands over instead
    hit: int = 0


@dataclass(slots=True)
class ModelEngine:
    name: str
    role: str  # "prefill" or "decode"
    costs: EngineCosts
    on_prefilled: Callable[[ModelEngine, Job, float], None]  # a prefill engine's hand-over
    on_token: Callable[[ModelEngine, Job, float], None]  # a decode engine's token
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    busy_until: float | None = None
    version: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def admit(self, job: Job, already_computed: int = 0) -> None:
        """Look the prompt up in the cache now; `already_computed` tokens came with the request
        (a decode engine's loaded KV)."""
        bs = self.costs.block_size
        hit = 0
        for digest in job.prompt.digests(bs):
            if digest not in self.cache:
                break
            self.cache.move_to_end(digest)
            hit += bs
        job.hit = hit
        job.to_compute = max(len(job.prompt) - max(hit, already_computed), 1)
        self.hit_tokens += hit
        self.prompt_tokens += len(job.prompt)
        self.waiting.append(job)

    def cache_prompt(self, prompt: PromptBlocks) -> None:
        for digest in prompt.digests(self.costs.block_size):
            if digest in self.cache:
                self.cache.move_to_end(digest)
            else:
                self.cache[digest] = None
                self.version += 1
        while len(self.cache) > self.free_blocks_for_cache():
            self.cache.popitem(last=False)
            self.version += 1

    def held_blocks(self) -> int:
        bs = self.costs.block_size
        return sum((len(j.prompt) + j.outputs_left) // bs + 1 for j in self.running)

    def free_blocks_for_cache(self) -> int:
        return max(self.costs.num_blocks - self.held_blocks(), 0)

    def summary(self, known_version: int | None) -> EngineSummary:
        c = self.costs
        return EngineSummary(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            waiting_tokens=sum(j.to_compute for j in self.waiting),
            num_blocks_free=c.num_blocks - self.held_blocks(),
            num_blocks_total=c.num_blocks,
            block_size=c.block_size,
            max_num_batched_tokens=c.batch_tokens,
            cache_version=self.version,
            cached=None if known_version == self.version else frozenset(self.cache),
        )

    def step(self, now: float) -> float | None:
        """Run one step from `now`; its end time, or None when there is nothing to do."""
        c = self.costs
        if not self.waiting and not self.running:
            return None
        budget = c.batch_tokens - len(self.running)
        tokens = len(self.running)
        chunks: list[tuple[Job, int]] = []
        for job in self.waiting:
            if budget <= 0 or len(self.running) + len(chunks) >= c.max_running:
                break
            n = min(job.to_compute, budget)
            chunks.append((job, n))
            budget -= n
            tokens += n
        end = now + c.step_base_s + c.step_token_s * tokens
        for job in list(self.running):
            job.outputs_left -= 1
            self.on_token(self, job, end)
            if job.outputs_left == 0:
                self.running.remove(job)
        for job, n in chunks:
            job.to_compute -= n
            if job.to_compute == 0:
                self.waiting.remove(job)
                self.cache_prompt(job.prompt)
                if self.role == "prefill":
                    self.on_prefilled(self, job, end)
                else:  # the step that computes the prompt's last token samples the first output
                    job.outputs_left -= 1
                    self.on_token(self, job, end)
                    if job.outputs_left > 0:
                        self.running.append(job)
        return end
