"""Typed messages between the scheduler, its workers and the engine's clients.

Each step the scheduler sends one `SchedulerOutput` to every worker and gets one
`ModelRunnerOutput` back; clients get one `OutputBatch` per step. They are plain dataclasses of
ints, strings and lists, so they cross Ray without pickling anything but data. Workers keep
the token history of every running request themselves, so after a request's first step
only counts and new block ids travel, and a decode step under async scheduling can name a
token the scheduler has not seen yet (it is still being sampled by the previous step).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv.nixl.scheduler import ConnectorMetadata
    from kv.nixl.transfer_params import KVTransferParams


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the bad value (HTTP 400 upstream)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its bound; the client should retry later (HTTP 503)."""


class EngineFailedError(RuntimeError):
    """The engine's step loop failed: it serves nothing more until its supervisor replaces it."""


# The error text of the requests an engine ends when its step loop fails: the ingress knows by
# it that the request itself was fine and can be resumed on another engine.
ENGINE_FAILURE = "engine failure: "

# The error text of a request whose grammar its worker cannot compile: the ingress answers it
# with a 400 naming the field that asked for the grammar (`StructuredOutput.param`).
INVALID_GRAMMAR = "invalid grammar: "

# What a `StructuredOutput` constrains the output to (its `spec`): any JSON object (none), the
# JSON schema (as JSON text), the regex, the grammar (xgrammar's EBNF).
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar every output token must keep to. Plain text, so that the engine and the API,
    which load neither torch nor xgrammar (docs/design.md §14), carry it; the worker compiles it
    (worker/grammar.py) and masks each step's logits by it (worker/grammar_mask.py)."""

    kind: str
    spec: str = ""
    param: str = "response_format"  # the request field that asked for it, which a 400 names

    def problem(self) -> str | None:
        """Why this cannot be a grammar at all (what it says is xgrammar's to judge), or None."""
        if self.kind not in STRUCTURED_KINDS:
            return f"kind {self.kind!r} is not one of {STRUCTURED_KINDS}"
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            return f"a {self.kind} needs its text"
        return None


GREEDY_BELOW_TEMPERATURE = 1e-5

# top_k beyond the vocabulary means "off"; the sampler clamps it. The bound keeps it a C int.
MAX_TOP_K = 2**31 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Alternatives a logprob may come with: OpenAI's bound for chat (completions allow 5).
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as OpenAI's
MAX_STOP_TOKEN_IDS = 256  # each is compared with every sampled token


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request samples; the knobs past `top_k` have vLLM's semantics (worker/sampler.py)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # each output token's own logprob
    top_logprobs: int = 0  # and its N most likely alternatives (needs `logprobs`)
    # The prompt's logprobs, each with this many alternatives; None: not computed.
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and `stop_token_ids` cannot be sampled before this many outputs
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # Draws already taken from this request's seeded random stream: a request resumed on
    # another engine after its own was lost goes on with the stream where it stopped.
    random_offset: int = 0
    # The prompt's last this many tokens are this request's own earlier outputs (a request
    # resumed on another engine): penalties count them as generated.
    num_prior_outputs: int = 0
    # A grammar the output keeps to; it also ends the output, with EOS once it is complete.
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 to inf and NaN: such a request
        # would sample garbage. It is greedy for every practical purpose, so it is greedy.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens it has seen (the worker then counts them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes its logits before the draw beyond temperature and filters:
        a batch with no such request skips that work entirely."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self) -> None:
        """Refuse what the sampler cannot run; the engine checks again at admission, because
        a request that fails inside a step costs that step's other requests their work."""
        checks = (
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer of at least 1"),
            ("temperature", _is_number(self.temperature) and 0.0 <= self.temperature <= 2.0, "must be in [0, 2]"),
            ("top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            (
                "top_k",
                _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
                f"must be an integer in [0, {MAX_TOP_K}] (0 disables it)",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "seed",
                self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63),
                "must fit a signed 64-bit integer",
            ),
            ("random_offset", _is_int(self.random_offset) and self.random_offset >= 0, "must be an integer >= 0"),
            (
                "top_logprobs",
                _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                f"must be an integer in [0, {MAX_TOP_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
                f"must be null or an integer in [0, {MAX_TOP_LOGPROBS}]",
            ),
            ("min_p", _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            (
                "presence_penalty",
                _is_number(self.presence_penalty) and -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
                f"must be in [{-MAX_PENALTY}, {MAX_PENALTY}]",
            ),
            (
                "frequency_penalty",
                _is_number(self.frequency_penalty) and -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
                f"must be in [{-MAX_PENALTY}, {MAX_PENALTY}]",
            ),
            (
                "repetition_penalty",
                _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < float("inf"),
                "must be a finite number above 0",
            ),
            (
                "min_tokens",
                _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                "must be an integer in [0, max_tokens]",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                f"must be at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
            ),
            (
                "logit_bias",
                all(
                    _is_int(t) and t >= 0 and _is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias
                ),
                f"must map token ids (integers >= 0) to biases in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
            ),
            (
                "num_prior_outputs",
                _is_int(self.num_prior_outputs) and self.num_prior_outputs >= 0,
                "must be an integer >= 0",
            ),
        )
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name}={getattr(self, name)!r} {why}", param=name)
        if self.structured is not None:
            self._validate_structured(self.structured)

    def _validate_structured(self, structured: object) -> None:
        if not isinstance(structured, StructuredOutput) or not isinstance(structured.param, str):
            raise InvalidRequestError(f"structured={structured!r} is not a StructuredOutput", param="structured")
        why = structured.problem()
        if why is not None:
            raise InvalidRequestError(f"{structured.param}: {why}", param=structured.param)
        # The grammar ends the output by allowing only EOS once it is complete: neither may hold it back.
        for name in ("ignore_eos", "min_tokens"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} cannot be combined with {structured.param}", param=name)


# A token's alternatives: the most likely tokens at its position, (token id, logprob), best first.
TopLogprobs = list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Logprobs of a run of consecutive tokens, each its log_softmax of the raw logits (no
    temperature, penalty or bias: vLLM's default). For a prompt, `start` is the index of the
    first token scored (token 0 has nothing before it to be scored on)."""

    start: int
    logprobs: list[float]
    top: list[TopLogprobs]  # one list per token, empty when no alternatives were asked for


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request's first step on a worker: everything the worker keeps for it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[list[int]]  # one list per cache group
    num_computed_tokens: int
    # Tokens after the prompt that its prompt logprobs also score: a prefill engine computes
    # the prompt but its last token (engine/pd.py), whose logprob its last row still gives.
    scored_tail: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A later step of a request the worker already knows."""

    req_id: str
    num_computed_tokens: int
    new_block_ids: list[list[int]]  # appended per group; the full lists when `resumed`
    resumed: bool = False  # re-scheduled after preemption: blocks replaced, KV recomputed


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: list[str]  # the worker forgets these before running the step
    # Attention blocks the worker zeroes on its compute stream before this step's forward;
    # None when nothing is to be zeroed (or the model has no Mamba pages to go stale).
    new_block_ids_to_zero: list[int] | None
    kv_connector_meta: ConnectorMetadata | None = None
    # Hybrid prefix caching (docs/design.md §21), (source, destination) page ids copied whole
    # in every cache buffer: a hit's state checkpoint into the request's slot before the
    # forward, and a slot into a new checkpoint page after it.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    step_id: int
    sampled: dict[str, int]  # requests whose scheduled chunk reached their last known token
    logprobs: dict[str, float] = field(default_factory=dict)
    num_zeroed_blocks: int = 0
    # KV transfers that ended since the last step (NIXL connector): requests whose pages a
    # decode side has read from this (prefill) worker, loads into this (decode) worker that
    # landed, and loads that failed with the local block ids left invalid.
    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_loads: dict[str, list[int]] = field(default_factory=dict)
    # Requests this worker could not run (a bad message, a failed forward or sampling): each
    # fails alone with the reason; the rest of the step ran.
    failed_reqs: dict[str, str] = field(default_factory=dict)
    # A prefill engine under --kv-verify: per request handed over in this step, per prefill
    # rank (a worker gives its own), per decode rank, per cache group, one checksum per block,
    # taken right after the forward (kv/nixl/verify.py; the `Checksums` of kv/nixl/transfer_params.py).
    kv_checksums: dict[str, list[list[list[list[int]]]]] = field(default_factory=dict)
    top_logprobs: dict[str, TopLogprobs] = field(default_factory=dict)  # of requests that ask
    # The prompt tokens this step's chunk scored, of requests that ask for prompt logprobs.
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens of one request since its last output; `finish_reason` set on the last one."""

    req_id: str
    new_token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    kv_transfer_params: KVTransferParams | None = None  # a prefill engine's answer
    top_logprobs: list[TopLogprobs] | None = None  # per new token, when asked for
    # The whole prompt's (start 1), once: with the first output, or a prefill engine's hand-over.
    prompt_logprobs: Logprobs | None = None


# The slots' own setters, which skip the frozen check: see `request_output`.
_SET_REQUEST_OUTPUT = tuple(getattr(RequestOutput, f.name).__set__ for f in fields(RequestOutput))


def request_output(
    req_id: str,
    new_token_ids: list[int],
    logprobs: list[float] | None,
    finish_reason: str | None,
    num_prompt_tokens: int,
    num_output_tokens: int,
    error: str | None,
) -> RequestOutput:
    """`RequestOutput(...)` without `kv_transfer_params` and alternatives, the same object built in half the
    time. A client builds one per running request per step from an `OutputBatch`, and a frozen
    dataclass's `__init__` sets every field through `object.__setattr__`, which looks each one
    up again."""
    out = object.__new__(RequestOutput)
    s_id, s_new, s_logprobs, s_reason, s_prompt, s_output, s_error, s_params, s_top, s_prompt_lp = _SET_REQUEST_OUTPUT
    s_id(out, req_id)
    s_new(out, new_token_ids)
    s_logprobs(out, logprobs)
    s_reason(out, finish_reason)
    s_prompt(out, num_prompt_tokens)
    s_output(out, num_output_tokens)
    s_error(out, error)
    s_params(out, None)
    s_top(out, None)
    s_prompt_lp(out, None)
    return out


@dataclass(frozen=True, slots=True)
class OutputBatch:
    """What one step (or one abort) produced for the clients. The common decode step, one new
    token for a request that goes on, travels as parallel flat lists (`req_ids[i]` got
    `token_ids[i]`, its `num_output_tokens[i]`-th output): no object per request and step for
    the scheduler to build and Ray to pickle. Everything else (a finish, an error, logprobs, a
    hand-over) is a whole `RequestOutput` in `others`, which comes after the tokens: a request
    in both got its token first."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    others: list[RequestOutput] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids) + len(self.others)

    def __iter__(self) -> Iterator[RequestOutput]:
        """Every output as a `RequestOutput`, in the order a client must apply them."""
        for req_id, token, num_prompt, num_output in zip(
            self.req_ids, self.token_ids, self.num_prompt_tokens, self.num_output_tokens, strict=True
        ):
            yield request_output(req_id, [token], None, None, num_prompt, num_output, None)
        yield from self.others


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_free: int
    blocks_zeroed: int
    blocks_skipped: int
    extra: dict[str, Any] = field(default_factory=dict)
