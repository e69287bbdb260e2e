"""How each endpoint writes choices' deltas as OpenAI objects: whole responses, stream chunks
and the closing usage chunk. Logprobs are the sampled tokens' own (the engine computes no
alternatives, so `top_logprobs` stays empty). A chat with tools has its text split into
content and tool calls (api/tool_calls.py) the same way whole and streamed."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel

from api.errors import APIError
from api.generation import Delta
from api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from api.text import TextModel
from api.tool_calls import ParsedCall, ToolCallParser, ToolUse


def usage_of(deltas: Iterable[Delta]) -> Usage:
    prompt = completion = 0
    for d in deltas:
        prompt += d.prompt_tokens
        completion += d.completion_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _joined(deltas: Iterable[Delta]) -> list[Delta]:
    """One delta per choice, in index order: what a non-streaming response reports."""
    by_index: dict[int, list[Delta]] = defaultdict(list)
    for d in deltas:
        by_index[d.index].append(d)
    joined = []
    for index in sorted(by_index):
        parts = by_index[index]
        logprobs = [lp for d in parts for lp in d.logprobs or ()]
        last = parts[-1]
        joined.append(
            Delta(
                index,
                "".join(d.text for d in parts),
                [t for d in parts for t in d.token_ids],
                logprobs or None,
                last.finish_reason,
                last.prompt_tokens,
                last.completion_tokens,
            )
        )
    return joined


class Format(ABC):
    def __init__(self, req_id: str, model_name: str, model: TextModel, logprobs: bool) -> None:
        self.req_id = req_id
        self.model_name = model_name
        self.model = model
        self.logprobs = logprobs

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        """Chunks sent before any text."""
        return []

    @abstractmethod
    def chunks(self, delta: Delta) -> list[BaseModel]:
        """The stream chunks for one delta."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    @abstractmethod
    def response(self, deltas: list[Delta]) -> BaseModel: ...


class CompletionFormat(Format):
    def __init__(self, req_id: str, model_name: str, model: TextModel, logprobs: bool) -> None:
        super().__init__(req_id, model_name, model, logprobs)
        self._offsets: dict[int, int] = defaultdict(int)  # text offset of each choice's next token

    def _logprobs(self, delta: Delta) -> CompletionLogprobs | None:
        if not self.logprobs or delta.logprobs is None:
            return None
        tokens = [self.model.token_text(t) for t in delta.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets[delta.index])
            self._offsets[delta.index] += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(delta.logprobs), text_offset=offsets)

    def _choice(self, delta: Delta) -> CompletionChoice:
        return CompletionChoice(
            index=delta.index, text=delta.text, logprobs=self._logprobs(delta), finish_reason=delta.finish_reason
        )

    def chunks(self, delta: Delta) -> list[BaseModel]:
        return [Completion(id=self.req_id, model=self.model_name, choices=[self._choice(delta)])]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return Completion(id=self.req_id, model=self.model_name, choices=[], usage=usage)

    def response(self, deltas: list[Delta]) -> BaseModel:
        return Completion(
            id=self.req_id,
            model=self.model_name,
            choices=[self._choice(d) for d in _joined(deltas)],
            usage=usage_of(deltas),
        )


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


class ChatFormat(Format):
    def __init__(
        self, req_id: str, model_name: str, model: TextModel, logprobs: bool, tools: ToolUse | None = None
    ) -> None:
        super().__init__(req_id, model_name, model, logprobs)
        self.tools = tools
        self._parsers: dict[int, ToolCallParser] = {}  # each streamed choice's

    def _finish(self, calls: list[ParsedCall], finish: str | None) -> str | None:
        assert self.tools is not None
        unmet = self.tools.unmet(calls)
        if unmet is not None:
            raise APIError(
                500,
                f"{unmet} (raypd does not constrain the output to a call)",
                type="server_error",
                code="tool_call_missing",
            )
        return "tool_calls" if calls and finish == "stop" else finish

    def _logprobs(self, delta: Delta) -> ChatLogprobs | None:
        if not self.logprobs or delta.logprobs is None:
            return None
        content = []
        for token_id, logprob in zip(delta.token_ids, delta.logprobs, strict=False):
            token = self.model.token_text(token_id)
            content.append(TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode())))
        return ChatLogprobs(content=content)

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        # OpenAI's first chunk of each choice names the role.
        return [
            ChatCompletionChunk(
                id=self.req_id,
                model=self.model_name,
                choices=[ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
            )
            for i in range(num_choices)
        ]

    def chunks(self, delta: Delta) -> list[BaseModel]:
        finish = delta.finish_reason
        if self.tools is None:
            messages = [DeltaMessage(content=delta.text or None)]
        else:
            parser = self._parsers.setdefault(delta.index, ToolCallParser(self.tools.max_calls))
            first = len(parser.calls)
            content, calls = parser.push(delta.text, final=finish is not None)
            if finish is not None:
                finish = self._finish(parser.calls, finish)
            # As OpenAI streams a call: its id, type and name first, then its arguments.
            messages = [DeltaMessage(content=content)] if content or not calls else []
            for index, call in enumerate(calls, start=first):
                head = FunctionCallDelta(name=call.name, arguments="")
                messages.append(
                    DeltaMessage(tool_calls=[ToolCallDelta(index=index, id=_call_id(), type="function", function=head)])
                )
                messages.append(
                    DeltaMessage(
                        tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=call.arguments))]
                    )
                )
        last = len(messages) - 1
        return [
            ChatCompletionChunk(
                id=self.req_id,
                model=self.model_name,
                choices=[
                    ChatChunkChoice(
                        index=delta.index,
                        delta=message,
                        logprobs=self._logprobs(delta) if i == 0 else None,
                        finish_reason=finish if i == last else None,
                    )
                ],
            )
            for i, message in enumerate(messages)
        ]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.req_id, model=self.model_name, choices=[], usage=usage)

    def _choice(self, delta: Delta) -> ChatChoice:
        message, finish = AssistantMessage(content=delta.text), delta.finish_reason
        if self.tools is not None:
            parser = ToolCallParser(self.tools.max_calls)
            content, calls = parser.push(delta.text, final=True)
            finish = self._finish(calls, finish)
            tool_calls = [
                ToolCall(id=_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
            ]
            message = AssistantMessage(content=content or None, tool_calls=tool_calls or None)
        return ChatChoice(index=delta.index, message=message, logprobs=self._logprobs(delta), finish_reason=finish)

    def response(self, deltas: list[Delta]) -> BaseModel:
        choices = [self._choice(d) for d in _joined(deltas)]
        return ChatCompletion(id=self.req_id, model=self.model_name, choices=choices, usage=usage_of(deltas))
