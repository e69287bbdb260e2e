"""OpenAI's protocol as pydantic models: the requests raypd reads and the responses it writes.

Unknown request fields are ignored, as OpenAI's server does, so clients that send newer or
vendor fields still work. Every known field carries its real bounds in the schema, so
`/openapi.json` states them and a bad value is a 400 naming the field before any work is
done. The sampling bounds are the ones `SamplingParams.validate` (which the engine runs again
at admission) and the sampler accept; what depends on the model (a token id below the
vocabulary size, prompt plus `max_tokens` within the context) is checked where the model is known.

Requests are validated strictly: a boolean is `true` or `false`, a number is a JSON number,
never a string, and `true` is not a token id.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine.messages import MAX_TOP_K, InvalidRequestError, SamplingParams

MAX_N = 16  # choices per request; each choice is one engine request
MAX_PROMPTS = 64  # prompts in one completion request, each run n times
MAX_CHOICES = 128  # prompts x n: engine requests a response waits on, all of them queued at once
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_STOP_CHARS = 256  # the engine decodes this many tokens' text after each step to find one
MAX_TEXT_CHARS = 2**20  # a prompt or a message; far beyond any context, so only a bound on work
MAX_NAME_CHARS = 256  # model, user and message names
MAX_MESSAGES = 4096  # messages in a chat, and content parts in one message
MAX_LOGPROBS = 5  # /v1/completions, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions, as OpenAI allows
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what torch.Generator.manual_seed takes as a signed seed


# Every string has a length bound, and pydantic checks a bounded string for valid unicode
# (error `string_unicode`): JSON can carry lone surrogates ("\ud800"), which no tokenizer
# and no UTF-8 response can hold.
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_TEXT_CHARS)]
MaxTokens = Annotated[int, Field(ge=1)]  # its upper bound, the context less the prompt, is checked once tokenized
Probability = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


def _unix_now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions. None means "the default", because
    some clients send explicit nulls."""

    model: Name | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None  # vLLM's extension; -1 or 0 disables it
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # vLLM's extension, for benchmarks that need fixed lengths
    user: Name | None = None  # accepted and ignored

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI: options for a stream that will not happen are a client's mistake.
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        top_k = self.top_k or 0
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
        )
        params.validate()
        return params


class CompletionRequest(_SamplingRequest):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text to tokenize, or token ids as given."""
        p = self.prompt
        prompts = cast("list[str | list[int]]", [p] if isinstance(p, str) or isinstance(p[0], int) else p)
        if len(prompts) * self.num_choices > MAX_CHOICES:
            raise InvalidRequestError(
                f"{len(prompts)} prompts with n={self.num_choices} are more than {MAX_CHOICES} choices", param="n"
            )
        return list(prompts)


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


# -- responses ------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: list[dict[str, float]] | None = None  # alternatives are not computed


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, object]] = []  # alternatives are not computed


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


def _omit_none(value: object) -> bool:
    return value is None


class DeltaMessage(BaseModel):
    """A chunk's change to the message: absent fields are left out, as OpenAI sends them."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_unix_now)
    owned_by: str = "raypd"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
