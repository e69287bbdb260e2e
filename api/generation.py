"""Running a request's choices on the engines and turning their token outputs into text deltas.

Every choice of a response (n choices per prompt, one or more prompts) is one engine
request. Each is submitted and must produce its first output before the HTTP response
starts, so a request the engine refuses (bad value, full queue) becomes a proper error
status instead of an error inside a 200 stream. Leaving a delta stream early, for any
reason, aborts its engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from api.errors import APIError
from api.metrics import Metrics, RequestTimer
from api.router import Router
from api.text import Detokenizer, StopBuffer, TextModel
from engine.messages import INVALID_GRAMMAR, InvalidRequestError, Logprobs, RequestOutput, SamplingParams, TopLogprobs


@dataclass(frozen=True, slots=True)
class Choice:
    """One engine request behind one choice of a response."""

    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    counts_prompt: bool  # the first choice of its prompt: OpenAI counts a prompt's tokens once
    echo: str | None = None  # the prompt's text, which the response shows before the output
    # The completion's tokens are not shown (`echo` with max_tokens 0: the engine ran one token).
    hide_output: bool = False


@dataclass(frozen=True, slots=True)
class PromptPart:
    """A choice's prompt, on its first delta, when the response shows it or its logprobs."""

    text: str | None  # `Choice.echo`
    token_ids: list[int]
    logprobs: Logprobs | None  # from token 1, when asked for


@dataclass(frozen=True, slots=True)
class Delta:
    """What a choice added since its last delta; the last one has `finish_reason` and usage."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    top_logprobs: list[TopLogprobs] | None = None
    prompt: PromptPart | None = None  # on a choice's first delta only


class ChoiceStream:
    def __init__(
        self,
        outputs: AsyncGenerator[RequestOutput, None],
        choice: Choice,
        model: TextModel,
        metrics: Metrics,
        arrival: float,
    ) -> None:
        self._outputs = outputs
        self._choice = choice
        self._detok = Detokenizer(model, choice.prompt_ids, skip_eos=not choice.sampling.ignore_eos)
        self._stop = StopBuffer(choice.sampling.stop)
        self._metrics = metrics
        self._timer = RequestTimer(metrics, arrival)
        self._last: RequestOutput | None = None
        self._prompt_shown = False
        self._num_outputs = 0

    async def first(self) -> None:
        """Wait for the engine to accept the request and produce its first output. A grammar
        the worker could not compile fails the request at its first step: the client's error,
        raised here so that it is a 400 before any response starts."""
        self._last = out = await anext(self._outputs)
        structured = self._choice.sampling.structured
        if structured is not None and out.finish_reason == "error" and (out.error or "").startswith(INVALID_GRAMMAR):
            raise InvalidRequestError((out.error or "")[len(INVALID_GRAMMAR) :], param=structured.param)

    async def close(self) -> None:
        """Abort the engine request of a choice whose deltas were never read."""
        await self._outputs.aclose()

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        out = self._last
        try:
            while out is not None:
                delta = self._delta(out)
                if delta.finish_reason is not None or delta.text or delta.token_ids or delta.prompt:
                    yield delta
                if delta.finish_reason is not None:
                    return
                out = self._last = await anext(self._outputs)
        finally:
            await self._outputs.aclose()  # aborts the engine request unless it finished
            self._timer.finish()
            if self._last is not None:
                self._metrics.prompt_tokens.inc(self._last.num_prompt_tokens if self._choice.counts_prompt else 0)
                self._metrics.generation_tokens.inc(self._last.num_output_tokens)

    def _delta(self, out: RequestOutput) -> Delta:
        if out.finish_reason in ("error", "abort"):
            raise APIError(500, f"The engine failed the request: {out.error or out.finish_reason}", type="server_error")
        self._timer.tokens(len(out.new_token_ids))
        final = out.finish_reason is not None
        choice = self._choice
        ids = self._shown_ids(out, final)
        text = ""
        before_min = choice.sampling.min_tokens - self._num_outputs  # of these, outputs before min_tokens
        self._num_outputs += len(out.new_token_ids)
        if before_min > 0 and choice.sampling.stop:
            head, ids = ids[:before_min], ids[before_min:]
            text = self._stop.pass_through(self._detok.push(head, final and not ids))
        text += self._stop.push(self._detok.push(ids, final), final)
        # A stop string found here ends the choice even if the engine has not seen it yet.
        finish = "stop" if self._stop.stopped else out.finish_reason
        prompt = None
        if not self._prompt_shown and (choice.echo is not None or out.prompt_logprobs is not None):
            self._prompt_shown = True
            prompt = PromptPart(choice.echo, choice.prompt_ids, out.prompt_logprobs)
        if choice.hide_output:
            text, token_ids, logprobs, top = "", [], None, None
        else:
            token_ids, logprobs, top = out.new_token_ids, out.logprobs, out.top_logprobs
        if finish is None:
            return Delta(choice.index, text, token_ids, logprobs, top_logprobs=top, prompt=prompt)
        prompt_tokens = out.num_prompt_tokens if choice.counts_prompt else 0
        completion_tokens = 0 if choice.hide_output else out.num_output_tokens
        return Delta(choice.index, text, token_ids, logprobs, finish, prompt_tokens, completion_tokens, top, prompt)

    def _shown_ids(self, out: RequestOutput, final: bool) -> list[int]:
        """The new tokens that become text: a stop token id that ended the output has none, as in vLLM."""
        ids = out.new_token_ids
        stop_ids = self._choice.sampling.stop_token_ids
        if final and out.finish_reason == "stop" and ids and ids[-1] in stop_ids:
            return ids[:-1]
        return ids


async def start(
    router: Router, model: TextModel, metrics: Metrics, choices: list[Choice], req_id: str
) -> AsyncGenerator[Delta, None]:
    """Submit every choice; return their merged deltas once each has its first output, or raise
    what the engine refused (after aborting the choices it accepted)."""
    arrival = time.monotonic()
    streams = [
        ChoiceStream(router.generate(c.prompt_ids, c.sampling, f"{req_id}-{c.index}"), c, model, metrics, arrival)
        for c in choices
    ]
    # return_exceptions: each stream is idle before the failed ones are closed.
    results = await asyncio.gather(*(s.first() for s in streams), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
        raise failure
    return merge([s.deltas() for s in streams])


async def merge(streams: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[Delta, None]:
    """Deltas of all streams as they come; closing this closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[Delta | Exception | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async with aclosing(stream) as s:
                async for delta in s:
                    queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
