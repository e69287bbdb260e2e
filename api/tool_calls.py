"""Tool calls out of a chat model's text, in the Hermes format that Qwen's templates teach:

    Some text.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One parser serves whole responses and streams (a whole response is one push of its whole
text), so a streamed reply's content and calls are the whole reply's, piece by piece. Text
that might still become `<tool_call>` is held back, as a stop string's start is. A block whose
JSON is not a call (`name` a string, `arguments` an object) is left in the content as the
model wrote it: the client sees what came out rather than losing it. Content is the text
outside the calls without its trailing whitespace (the newline before a call is layout, not
content), and none at all when that is empty.

raypd constrains no output, so `tool_choice: "required"` or a named function cannot make the
model call; it is checked afterwards (`ToolUse.unmet`) and a reply without the call it
demanded is an error, never content passed off as the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from api.protocol import ChatCompletionRequest, NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request asks of tool calls: parse them, and whether one must come."""

    required: bool  # tool_choice "required" or a named function
    function: str | None  # the function tool_choice names
    max_calls: int | None  # 1 when parallel_tool_calls is false

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolUse | None:
        """None when calls are not parsed: no tools, or tool_choice "none" (the text is content)."""
        if not body.tools or body.tool_choice == "none":
            return None
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        return cls(
            required=body.tool_choice == "required" or named is not None,
            function=named,
            max_calls=1 if body.parallel_tool_calls is False else None,
        )

    def unmet(self, calls: list[ParsedCall]) -> str | None:
        """Why `calls` do not satisfy tool_choice, or None when they do."""
        if not self.required:
            return None
        if not calls:
            return "tool_choice requires a tool call and the model made none"
        wrong = next((c.name for c in calls if self.function is not None and c.name != self.function), None)
        if wrong is not None:
            return f"tool_choice requires a call to {self.function!r} and the model called {wrong!r}"
        return None


def parse_call(body: str) -> ParsedCall | None:
    """The call a `<tool_call>` block holds, or None if it holds something else."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_open(text: str) -> int:
    """Length of the longest tail of `text` that `OPEN` starts with."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)


@dataclass(slots=True)
class ToolCallParser:
    """Text in as it is generated; content and finished calls out."""

    max_calls: int | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet known to be content or a call
    _inside: bool = False  # the buffer is the body of an open `<tool_call>`
    _space: str = ""  # trailing whitespace of the content, sent once more content follows

    def push(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that `text` completes; `final` flushes what was held."""
        self._buffer += text
        pieces: list[str] = []
        found: list[ParsedCall] = []
        while not self._full():
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_open(self._buffer)
                    pieces.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                pieces.append(self._buffer[:start])
                self._buffer, self._inside = self._buffer[start + len(OPEN) :], True
                continue
            end = self._buffer.find(CLOSE)
            if end < 0 and not final:
                break
            body = self._buffer if end < 0 else self._buffer[:end]  # a call cut off by EOS still counts
            call = parse_call(body)
            if call is None:
                pieces.append(OPEN + body + ("" if end < 0 else CLOSE))
            else:
                found.append(call)
                self.calls.append(call)
            self._buffer, self._inside = ("" if end < 0 else self._buffer[end + len(CLOSE) :]), False
        if self._full():
            self._buffer = ""  # parallel_tool_calls false: nothing after the first call is returned
        return self._content("".join(pieces)), found

    def _full(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def _content(self, new: str) -> str:
        text = self._space + new
        body = text.rstrip()
        self._space = text[len(body) :]
        return body
