"""Prompts as the model sees them: the chat rendering that `/v1/chat/completions` and
`/tokenize` share, and vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info` (their request
and response shapes are vLLM's, so tools written for vLLM work unchanged: lm-eval's `remote`
tokenizer backend tokenizes through them).

`/tokenize` answers exactly the ids a generation request with the same prompt or messages
would run on, so a client can count tokens or check a template without generating.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from api.protocol import MAX_MESSAGES, MAX_TEXT_CHARS, MAX_TOOLS, ChatMessage, Name, Text, Tool, _Request
from api.text import TextModel
from engine.messages import InvalidRequestError

ChatMessages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


def chat_prompt(
    model: TextModel,
    messages: list[ChatMessage],
    tools: list[Tool] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    special: bool = False,
) -> list[int]:
    """The chat's token ids: rendered with the model's template, the tools as the client sent
    them. The template places any special tokens; `special` adds the tokenizer's own too."""
    prompt = model.render_chat(
        [m.as_template_input() for m in messages],
        tools=[t.model_dump(exclude_unset=True) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return model.encode(prompt, special=special)


class TokenizeRequest(_Request):
    """vLLM's two tokenize requests in one: a `prompt`, or chat `messages` with their options."""

    model: Name | None = None
    prompt: Text | None = None
    messages: ChatMessages | None = Field(default=None, validate_default=True)
    add_special_tokens: bool | None = None  # default: true for a prompt; a chat's template places them
    add_generation_prompt: bool | None = None  # chat only; default true
    continue_final_message: bool | None = None  # chat only; default false
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # chat only
    return_token_strs: bool | None = False

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, value: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if "prompt" not in info.data:  # the prompt was refused already
            return value
        if (value is None) == (info.data["prompt"] is None):
            raise ValueError("give either prompt or messages (exactly one)")
        return value

    def ids(self, model: TextModel) -> list[int]:
        if self.messages is None:
            assert self.prompt is not None
            for name in ("add_generation_prompt", "continue_final_message", "tools"):
                if getattr(self, name) is not None:
                    raise InvalidRequestError(f"{name} applies to messages, not to a prompt", param=name)
            return model.encode(self.prompt, special=self.add_special_tokens is not False)
        return chat_prompt(
            model,
            self.messages,
            self.tools,
            self.add_generation_prompt is not False,
            bool(self.continue_final_message),
            special=bool(self.add_special_tokens),
        )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Name | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_TEXT_CHARS)]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(model: TextModel, body: TokenizeRequest) -> TokenizeResponse:
    ids = body.ids(model)
    strs = [model.tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)


def detokenize(model: TextModel, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of `tokens`, special tokens included, so a tokenize round trip gives the prompt back."""
    model.check_ids(body.tokens, param="tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens, skip_special_tokens=False))


class TokenizerInfo(BaseModel):
    """vLLM's `/tokenizer_info`: what a client needs to build prompts as the server does."""

    model_config = ConfigDict(extra="allow")  # the special tokens, by their names in tokenizer_config.json

    chat_template: str | None
    model_max_length: int


def tokenizer_info(model: TextModel) -> TokenizerInfo:
    return TokenizerInfo(
        chat_template=model.chat_template, model_max_length=model.max_model_len, **model.special_tokens
    )
