"""How each endpoint writes choices' deltas as OpenAI objects: whole responses, stream chunks
and the closing usage chunk. Logprobs are the sampled tokens' own (the engine computes no
alternatives, so `top_logprobs` stays empty)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel

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
    TokenLogprob,
    Usage,
)
from api.text import TextModel


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
    def chunk(self, delta: Delta) -> BaseModel: ...

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

    def chunk(self, delta: Delta) -> BaseModel:
        return Completion(id=self.req_id, model=self.model_name, choices=[self._choice(delta)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return Completion(id=self.req_id, model=self.model_name, choices=[], usage=usage)

    def response(self, deltas: list[Delta]) -> BaseModel:
        return Completion(
            id=self.req_id,
            model=self.model_name,
            choices=[self._choice(d) for d in _joined(deltas)],
            usage=usage_of(deltas),
        )


class ChatFormat(Format):
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

    def chunk(self, delta: Delta) -> BaseModel:
        choice = ChatChunkChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
        )
        return ChatCompletionChunk(id=self.req_id, model=self.model_name, choices=[choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.req_id, model=self.model_name, choices=[], usage=usage)

    def response(self, deltas: list[Delta]) -> BaseModel:
        choices = [
            ChatChoice(
                index=d.index,
                message=AssistantMessage(content=d.text),
                logprobs=self._logprobs(d),
                finish_reason=d.finish_reason,
            )
            for d in _joined(deltas)
        ]
        return ChatCompletion(id=self.req_id, model=self.model_name, choices=choices, usage=usage_of(deltas))
