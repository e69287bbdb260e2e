"""OpenAI's protocol as pydantic models: the requests raypd reads and the responses it writes.

A request field raypd does not implement is a 400 naming it (`extra="forbid"`), never silently
ignored: a client that asks for a penalty, a format or a feature the server would not apply
learns so instead of getting output it did not ask for. The fields that carry no behaviour
(who the user is, tags, storage and billing hints) are declared and accepted; each says why
ignoring it changes nothing the client gets. Every known field carries its real bounds in the schema, so
`/openapi.json` states them and a bad value is a 400 naming the field before any work is
done. The sampling bounds are the ones `SamplingParams.validate` (which the engine runs again
at admission) and the sampler accept; what depends on the model (a token id below the
vocabulary size, prompt plus `max_tokens` within the context) is checked where the model is known.

Requests are validated strictly: a boolean is `true` or `false`, a number is a JSON number,
never a string, and `true` is not a token id.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from api.structured import StructuredFields
from engine.messages import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    InvalidRequestError,
    SamplingParams,
)

MAX_N = 16  # choices per request; each choice is one engine request
MAX_PROMPTS = 64  # prompts in one completion request, each run n times
MAX_CHOICES = 128  # prompts x n: engine requests a response waits on, all of them queued at once
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_STOP_CHARS = 256  # the engine decodes this many tokens' text after each step to find one
MAX_TEXT_CHARS = 2**20  # a prompt or a message; far beyond any context, so only a bound on work
MAX_NAME_CHARS = 256  # model, user and message names
MAX_METADATA = 16  # key-value pairs in `metadata`, as OpenAI allows
MAX_TOOLS = 128  # functions in one request, as OpenAI allows
MAX_MESSAGES = 4096  # messages in a chat, and content parts in one message
MAX_LOGPROBS = 5  # /v1/completions, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions, as OpenAI allows; also vLLM's prompt_logprobs here
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of logit_bias; each is one scatter per sampled row
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
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # JSON keys are strings: a token id in one
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]  # OpenAI's rule


def _unix_now() -> int:
    return int(time.time())


def _omit_none(value: object) -> bool:
    return value is None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(StructuredFields, _Request):
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
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    # vLLM's extensions:
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None  # its upper bound is max_tokens
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # Accepted and ignored: none of these changes the output, the usage or the response's shape.
    user: Name | None = None  # an end user's id, for the provider's abuse monitoring
    safety_identifier: Name | None = None  # OpenAI's newer name for `user`
    prompt_cache_key: Name | None = None  # a hint for routing to a warm prefix cache: speed only
    metadata: Annotated[dict[Name, Text], Field(max_length=MAX_METADATA)] | None = None  # tags for stored outputs
    store: bool | None = None  # raypd stores no outputs; nothing to fetch later either way
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None  # price and latency only

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

    def token_ids_in(self, check: Callable[[list[int], str], None]) -> None:
        """The token ids the knobs name, checked against the vocabulary by `check(ids, param)`."""
        if self.stop_token_ids:
            check(self.stop_token_ids, "stop_token_ids")
        if self.logit_bias:
            check([int(t) for t in self.logit_bias], "logit_bias")

    def sampling(
        self, max_tokens: int, logprobs: bool, top_logprobs: int = 0, prompt_logprobs: int | None = None
    ) -> SamplingParams:
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
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logit_bias=tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items()),
            structured=self.structured_output(),
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
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 only with echo: the prompt is scored, nothing generated
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False  # the prompt comes back before the completion, with its logprobs if asked
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # vLLM's extension

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


class MediaPart(BaseModel):
    """An image, audio, video or file part. raypd serves a checkpoint's language model only (a
    multimodal directory's vision tower is not loaded), so such a part is refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "video_url", "file"]

    @model_validator(mode="after")
    def _refuse(self) -> MediaPart:
        raise ValueError(f"{self.type} content is not supported: this server serves text only")


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


# -- tools: function definitions for the template, calls in the history ---------------


class FunctionDefinition(_Request):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, handed to the chat template as given
    # Strict adherence to `parameters` needs constrained decoding; raypd parses what the model wrote.
    strict: Literal[False] | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Request):
    name: FunctionName
    arguments: Text  # a JSON object as a string, as OpenAI writes it


class MessageToolCall(_Request):
    id: Name
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_MESSAGES)] | None = None  # assistant only
    tool_call_id: Name | None = None  # tool only: the call this message answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in an assistant message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id is only allowed in a tool message")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as transformers hands it to a template; a call's arguments parsed to an
        object, as vLLM does, since templates write them with `tojson`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content if isinstance(part, TextPart))
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _json_object(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return message


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"a tool call's arguments are not JSON: {e}", param="messages") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("a tool call's arguments must be a JSON object", param="messages")
    return value


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call is returned
    add_generation_prompt: bool | None = True  # vLLM's extension
    continue_final_message: bool | None = False  # vLLM's extension: the reply goes on the last message
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: object, info: ValidationInfo) -> object:
        tools = info.data.get("tools") or []
        if value is not None and value != "none" and not tools:
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names the function {value.function.name!r}, which is not among the tools")
        return value


# -- responses ------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token, as OpenAI
    text_offset: list[int]
    # Per token, the `logprobs` most likely tokens and the token itself, by their text.
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(BaseModel):
    """vLLM's shape of one prompt logprob."""

    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's `prompt_logprobs`: None for the first token, then by token id the prompt's token and
    # its alternatives; only when asked for.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(default=None, exclude_if=_omit_none)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []  # the `top_logprobs` most likely tokens, best first


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_omit_none)


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


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_omit_none)
    arguments: str | None = Field(default=None, exclude_if=_omit_none)


class ToolCallDelta(BaseModel):
    """A call's first delta carries its id, type and name; later ones add to its arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_omit_none)
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    """A chunk's change to the message: absent fields are left out, as OpenAI sends them."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_none)


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
