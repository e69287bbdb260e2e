"""How each endpoint writes choices' deltas as OpenAI objects: whole responses, stream chunks
and the closing usage chunk. Logprobs are the sampled tokens' own and their alternatives, as
the workers computed them (worker/sampler.py); an echoed prompt's come from its prefill. A chat with tools has its text split into
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
    PromptLogprob,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from api.text import TextModel
from api.tool_calls import CallPiece, CallReader, ToolUse
from engine.messages import TopLogprobs


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
        top = [t for d in parts for t in d.top_logprobs or ()]
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
                top or None,
                next((d.prompt for d in parts if d.prompt is not None), None),
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
    """`logprobs` (N, or None): each token's logprob and a dict of the N most likely tokens and
    itself, by text, as OpenAI's legacy completions; with `echo` the prompt's tokens come first
    (the first with None). `prompt_logprobs` (vLLM's): the prompt's, by token id, in their own field."""

    def __init__(
        self, req_id: str, model_name: str, model: TextModel, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> None:
        super().__init__(req_id, model_name, model, logprobs is not None)
        self.top_n = logprobs or 0
        self.prompt_logprobs = prompt_logprobs
        self._offsets: dict[int, int] = defaultdict(int)  # text offset of each choice's next token

    def _top(self, own: int, logprob: float, top: TopLogprobs) -> dict[str, float]:
        text = self.model.token_text
        alternatives = {text(t): lp for t, lp in top[: self.top_n]}
        alternatives.setdefault(text(own), logprob)
        return alternatives

    def _logprobs(self, delta: Delta) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        ids: list[int] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        prompt = delta.prompt
        if prompt is not None and prompt.text is not None:
            ids += prompt.token_ids
            scored = prompt.logprobs
            logprobs.append(None)
            tops.append(None)
            for i, prompt_token in enumerate(prompt.token_ids[1:]):
                if scored is None or i >= len(scored.logprobs):
                    logprobs.append(None)
                    tops.append(None)
                    continue
                logprobs.append(scored.logprobs[i])
                tops.append(self._top(prompt_token, scored.logprobs[i], scored.top[i]))
        if delta.logprobs is not None:
            ids += delta.token_ids
            logprobs += delta.logprobs
            top: list[TopLogprobs] = delta.top_logprobs or [[] for _ in delta.logprobs]
            tops += [self._top(t, lp, a) for t, lp, a in zip(delta.token_ids, delta.logprobs, top)]
        if not ids:
            return None
        tokens = [self.model.token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets[delta.index])
            self._offsets[delta.index] += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets, top_logprobs=tops)

    def _prompt_logprobs(self, delta: Delta) -> list[dict[str, PromptLogprob] | None] | None:
        prompt = delta.prompt
        if self.prompt_logprobs is None or prompt is None or prompt.logprobs is None:
            return None
        text = self.model.token_text
        scored = prompt.logprobs
        entries: list[dict[str, PromptLogprob] | None] = [None]
        for token, logprob, top in zip(prompt.token_ids[1:], scored.logprobs, scored.top):
            entry = {str(token): PromptLogprob(logprob=logprob, decoded_token=text(token))}
            for t, lp in top[: self.prompt_logprobs]:
                entry.setdefault(str(t), PromptLogprob(logprob=lp, decoded_token=text(t)))
            entries.append(entry)
        return entries

    def _choice(self, delta: Delta) -> CompletionChoice:
        echo = delta.prompt.text if delta.prompt is not None and delta.prompt.text is not None else ""
        return CompletionChoice(
            index=delta.index,
            text=echo + delta.text,
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
            prompt_logprobs=self._prompt_logprobs(delta),
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


def _call_delta(piece: CallPiece) -> ToolCallDelta:
    if piece.name is None:
        return ToolCallDelta(index=piece.index, function=FunctionCallDelta(arguments=piece.arguments))
    head = FunctionCallDelta(name=piece.name, arguments=piece.arguments)
    return ToolCallDelta(index=piece.index, id=_call_id(), type="function", function=head)


class ChatFormat(Format):
    def __init__(
        self, req_id: str, model_name: str, model: TextModel, logprobs: bool, tools: ToolUse | None = None
    ) -> None:
        super().__init__(req_id, model_name, model, logprobs)
        self.tools = tools
        self._readers: dict[int, CallReader] = {}  # each streamed choice's

    def _finish(self, reader: CallReader, finish: str | None) -> str | None:
        assert self.tools is not None
        unmet = self.tools.unmet(reader)
        if unmet is not None:
            raise APIError(500, f"{unmet} (finish_reason {finish})", type="server_error", code="tool_call_missing")
        return "tool_calls" if reader.calls and finish == "stop" else finish

    def _logprobs(self, delta: Delta) -> ChatLogprobs | None:
        if not self.logprobs or delta.logprobs is None:
            return None
        content = []
        text = self.model.token_text
        tops = delta.top_logprobs or [[] for _ in delta.logprobs]
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=False):
            token = text(token_id)
            alternatives = [TopLogprob(token=text(t), logprob=lp, bytes=list(text(t).encode())) for t, lp in top]
            content.append(
                TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=alternatives)
            )
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
            reader = self._readers.setdefault(delta.index, self.tools.reader())
            content, pieces = reader.push(delta.text, final=finish is not None)
            if finish is not None:
                finish = self._finish(reader, finish)
            # As OpenAI streams a call: its id, type and name first, then its arguments.
            messages = [DeltaMessage(content=content)] if content or not pieces else []
            messages += [DeltaMessage(tool_calls=[_call_delta(piece)]) for piece in pieces]
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
            reader = self.tools.reader()
            content, _ = reader.push(delta.text, final=True)
            finish = self._finish(reader, finish)
            tool_calls = [
                ToolCall(id=_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reader.calls
            ]
            message = AssistantMessage(content=content or None, tool_calls=tool_calls or None)
        return ChatChoice(index=delta.index, message=message, logprobs=self._logprobs(delta), finish_reason=finish)

    def response(self, deltas: list[Delta]) -> BaseModel:
        choices = [self._choice(d) for d in _joined(deltas)]
        return ChatCompletion(id=self.req_id, model=self.model_name, choices=choices, usage=usage_of(deltas))
