"""Resuming a request on another engine when the engine serving it is lost.

An engine that dies mid-stream (or whose step loop fails) takes the request's KV and its place
in the batch with it, but every token it streamed has reached the client. The rest of the
answer is what the model gives for the prompt plus those tokens, with `max_tokens` less what
was sent: another engine (or the dead one's replacement, once its supervisor brought it back)
recomputes that longer prompt (under PD through a prefill engine, as any prompt) and the stream
goes on where it stopped, with no token repeated or missing.

What carries over: greedy decoding continues exactly as an undisturbed run, and so does a
seeded sampled request, whose random stream is advanced past the draws of the tokens already
sent (`SamplingParams.random_offset`). Stop strings are found by the API over the whole output
(`StopBuffer`), so one that spans the break still ends the choice; EOS and `max_tokens` are per
token and continue as they were, and so does `min_tokens`. Penalties keep their history: the
tokens already sent are the new prompt's tail, and `num_prior_outputs` tells the worker to count
them as outputs; a structured output's grammar is advanced by them (docs/design.md §17). The
prompt's logprobs went out with the first output and are not asked for again. What does not
carry over: an unseeded sampled request draws from a fresh stream, so its continuation is a
valid sample but not the one the lost engine would have drawn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace

from actors.client import EngineLostError
from engine.messages import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

# One try of a request on some engine(s): prompt, sampling, the try's request id.
Attempt = Callable[[list[int], SamplingParams, str], AsyncGenerator[RequestOutput, None]]


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    """How long a request may look for a live engine after losing one. The backoff doubles from
    `backoff_s` to `max_backoff_s`: the first retry usually finds another engine at once, later
    ones wait for a replacement (a few seconds)."""

    timeout_s: float = 30.0
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


class Progress:
    """What a request has streamed so far, across the engines that served it."""

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.sent: list[int] = []
        self._base = 0  # tokens sent before the current attempt

    def resume(self) -> tuple[list[int], SamplingParams]:
        """The next attempt's prompt and sampling: the tokens already sent become prompt."""
        self._base = len(self.sent)
        if not self.sent:
            return self.prompt_ids, self.sampling
        sent = len(self.sent)
        sampling = replace(
            self.sampling,
            max_tokens=self.sampling.max_tokens - sent,
            min_tokens=max(0, self.sampling.min_tokens - sent),
            num_prior_outputs=self.sampling.num_prior_outputs + sent,
            prompt_logprobs=None,
        )
        if sampling.seed is not None and not sampling.greedy:
            # One draw per token sent: the new engine's stream starts where the lost one was.
            sampling = replace(sampling, random_offset=sampling.random_offset + len(self.sent))
        return self.prompt_ids + self.sent, sampling

    def account(self, out: RequestOutput, req_id: str) -> RequestOutput:
        """`out` as the client's request: its id, its prompt, all of its output tokens."""
        self.sent += out.new_token_ids
        if not self._base:
            return out
        return replace(
            out,
            req_id=req_id,
            num_prompt_tokens=len(self.prompt_ids),
            num_output_tokens=self._base + out.num_output_tokens,
        )


async def resumable(
    attempt: Attempt,
    prompt_ids: list[int],
    sampling: SamplingParams,
    req_id: str,
    policy: MigrationPolicy,
    on_resume: Callable[[], None] = lambda: None,
) -> AsyncGenerator[RequestOutput, None]:
    """The request's outputs, tried again from where it stopped each time `attempt` loses its
    engine, until `policy.timeout_s` has passed (then the EngineLostError goes to the caller).
    `on_resume` is called before each new try."""
    progress = Progress(prompt_ids, sampling)
    deadline = time.monotonic() + policy.timeout_s
    backoff = policy.backoff_s
    tries = 0
    while True:
        prompt, params = progress.resume()
        # A fresh id per try: the lost engine's replacement, or a prefill engine still holding
        # the first try's KV for nobody, must not see a duplicate.
        try_id = req_id if tries == 0 else f"{req_id}-r{tries}"
        try:
            async with aclosing(attempt(prompt, params, try_id)) as outs:
                async for out in outs:
                    yield progress.account(out, req_id)
            return
        except EngineLostError as e:
            tries += 1
            if not policy.enabled or time.monotonic() + backoff > deadline:
                raise
            log.warning(
                "request %s lost its engine after %d tokens (%s); resuming it (try %d)",
                req_id,
                len(progress.sent),
                e,
                tries,
            )
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, policy.max_backoff_s)
        on_resume()
