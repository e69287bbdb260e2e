"""The soak test's mixed traffic and how each request's outcome is judged.

Every request ends as exactly one of:
- `ok`: served in full (a stream ended with a finish reason and `[DONE]`), a stream the client
  left on purpose, or a bad request refused with a 400 naming the field;
- `failed`: refused or ended with a clear error in OpenAI's shape (an HTTP error body, or an
  error event inside the stream followed by `[DONE]`);
- `lost`: anything else: a timeout, a cut connection, a stream without `[DONE]`, a body that is
  not OpenAI's shape, a bad request served as if it were fine. A soak run must lose none.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Literal

import httpx

Result = Literal["ok", "failed", "lost"]
KINDS = ("stream", "whole", "chat_stream", "n2", "abort", "bad")
WEIGHTS = (30, 20, 15, 10, 15, 10)

# Requests the API must refuse with a 400 naming the field; a JSON text, so some are not JSON.
BAD_BODIES: tuple[tuple[str, str], ...] = (
    ('{"prompt": "ab=1;?ab=", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "ab=1;?ab=", "temperature": "hot"}', "temperature"),
    ('{"prompt": "ab=1;?ab=", "n": 1000}', "n"),
    ('{"prompt": "ab=1;?ab=", "top_p": 0}', "top_p"),
    ('{"prompt": "ab=1;?ab=", "max_tokens": 100000}', "max_tokens"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": "ab=1;?ab=", "stream_options": {"include_usage": true}}', "stream_options"),
)


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str
    result: Result
    detail: str  # what happened: an error code, "served", the reason a request counts as lost


def _error_shape(data: Any) -> str | None:
    """The error's code (or type) and the start of its message if `data` is OpenAI's error
    body, else None."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
        return f"{error.get('code') or error.get('type')} ({error['message'][:60]})"
    return None


def _refusal(kind: str, r: httpx.Response) -> Outcome:
    try:
        code = _error_shape(r.json())
    except ValueError:
        code = None
    if code is None:
        return Outcome(kind, "lost", f"HTTP {r.status_code} without an OpenAI error body")
    if r.status_code in (429, 503) and not r.headers.get("Retry-After"):
        return Outcome(kind, "lost", f"HTTP {r.status_code} without Retry-After")
    return Outcome(kind, "failed", f"{r.status_code} {code}")


async def _stream(c: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any], leave_after: int | None) -> Outcome:
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return _refusal(kind, r)
        events, finished, error = 0, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                if error is not None:
                    return Outcome(kind, "failed", f"stream error {error}")
                return Outcome(kind, "ok" if finished else "lost", "served" if finished else "no finish reason")
            data = json.loads(line[6:])
            error = _error_shape(data) or error
            finished = finished or any(ch.get("finish_reason") for ch in data.get("choices", []))
            events += 1
            if leave_after is not None and events >= leave_after:
                return Outcome(kind, "ok", "left mid-stream")
        return Outcome(kind, "lost", "stream ended without [DONE]")


async def _whole(c: httpx.AsyncClient, kind: str, body: dict[str, Any], n: int) -> Outcome:
    r = await c.post("/v1/completions", json={**body, "n": n})
    if r.status_code != 200:
        return _refusal(kind, r)
    choices = r.json().get("choices", [])
    if len(choices) != n or not all(ch.get("finish_reason") for ch in choices):
        return Outcome(kind, "lost", "a choice without a finish reason")
    return Outcome(kind, "ok", "served")


async def _bad(c: httpx.AsyncClient, rng: random.Random) -> Outcome:
    text, param = rng.choice(BAD_BODIES)
    r = await c.post("/v1/completions", content=text, headers={"Content-Type": "application/json"})
    if r.status_code == 400 and _error_shape(r.json()) and r.json()["error"].get("param") == param:
        return Outcome("bad", "ok", "refused")
    if r.status_code == 503:
        return _refusal("bad", r)
    return Outcome("bad", "lost", f"HTTP {r.status_code} for a request refusing {param}")


async def request(c: httpx.AsyncClient, kind: str, prompt: str, max_tokens: int, rng: random.Random) -> Outcome:
    """One request of `kind`; transport failures and timeouts count as lost."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
    try:
        if kind == "stream":
            return await _stream(c, kind, "/v1/completions", body, None)
        if kind == "chat_stream":
            chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
            return await _stream(c, kind, "/v1/chat/completions", chat, None)
        if kind == "abort":
            return await _stream(c, kind, "/v1/completions", body, rng.randint(1, 4))
        if kind == "bad":
            return await _bad(c, rng)
        return await _whole(c, kind, body, 2 if kind == "n2" else 1)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a body that is not JSON
        return Outcome(kind, "lost", f"{type(e).__name__}: {e}")
