"""The scheduler's record of one request: two counters, as in vLLM v1.

`num_computed_tokens` is what has been *scheduled* into the cache (including steps still
running); the request's tokens are its prompt, the outputs reported so far, and
`num_placeholders` tokens being sampled by steps in flight. Each step hands out tokens so
computed catches up with that total, so prefill, chunked prefill, decode and recompute
after preemption are one mechanism.

The total itself, `num_tokens_with_placeholders`, is the stored counter and the number of
placeholders is derived from it: a step that samples a token adds one, and the token's
arrival turns a placeholder into an output without changing it. The scheduler's per-request
loops, which run for every running request every step, then read one field of the request
instead of three lists' lengths and the sampling parameters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.messages import Logprobs, SamplingParams, TopLogprobs
from kv.nixl.transfer_params import KVTransferParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Prompt logprobs as the steps score them (from token 1), sent once with its first output.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    scored_tail: tuple[int, ...] = ()  # NewRequestData.scored_tail
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)
    num_tokens_with_placeholders: int = field(init=False)  # prompt, outputs and placeholders
    max_num_tokens: int = field(init=False)  # prompt and max_tokens: no placeholder past it
    status: RequestStatus = RequestStatus.WAITING
    # The last step that used this request's blocks (computed into them or zeroed them):
    # they are freed only once it reports.
    last_step: int = -1
    known_to_workers: bool = False
    resumed: bool = False
    finish_reason: str | None = None
    num_emitted: int = 0  # outputs already sent to the client
    # Set at admission (`StopChecker.plain_limits`): below `plain_until` outputs, a token other
    # than `plain_stop_id` ends nothing and goes out as a plain token, so the scheduler's
    # per-token loop skips the full stop check. 0: every token takes the full path.
    plain_until: int = 0
    plain_stop_id: int = -1
    # Disaggregation: a decode request carries where its prompt's KV lives; a prefill
    # request (do_remote_decode) stops after its prompt and hands the KV over.
    kv_transfer_params: KVTransferParams | None = None
    do_remote_decode: bool = False
    load_done: bool = False
    num_external_tokens: int = 0  # granted to the load in flight
    error: str | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens_with_placeholders = self.num_prompt_tokens + len(self.output_token_ids)
        self.max_num_tokens = self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_placeholders(self) -> int:
        return self.num_tokens_with_placeholders - self.num_tokens

    @property
    def num_expected_outputs(self) -> int:
        return self.num_tokens_with_placeholders - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def wants_logprobs(self) -> bool:
        """Its outputs carry logprobs (of its tokens or its prompt): never a plain token."""
        return self.sampling.logprobs or self.sampling.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def add_prompt_logprobs(self, run: Logprobs) -> bool:
        """Take a chunk's prompt logprobs; a chunk computed again (after a preemption) adds
        only what was not scored yet. False if the run leaves a gap (a bug: the caller fails
        the request rather than send logprobs with a hole)."""
        have = 1 + len(self.prompt_logprobs)
        skip = have - run.start
        if skip < 0:
            return False
        self.prompt_logprobs += run.logprobs[skip:]
        self.prompt_top_logprobs += run.top[skip:]
        return True

    def take_prompt_logprobs(self) -> Logprobs | None:
        """The whole prompt's logprobs once every token is scored, the first time only."""
        if self.sampling.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        if 1 + len(self.prompt_logprobs) < self.num_prompt_tokens + len(self.scored_tail):
            return None
        self.prompt_logprobs_sent = True
        return Logprobs(1, self.prompt_logprobs, self.prompt_top_logprobs)
