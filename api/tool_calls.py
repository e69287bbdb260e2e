"""Tool calls out of a chat model's text.

`tool_choice: "auto"` (the default with tools) lets the model choose, and its calls are read in
the Hermes format that Qwen's templates teach:

    Some text.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose JSON is not a call (`name` a string, `arguments` an object) is left in the
content as the model wrote it: the client sees what came out rather than losing it. Content is
the text outside the calls without its trailing whitespace (the newline before a call is
layout, not content), and none at all when that is empty. Text that might still become
`<tool_call>` is held back, as a stop string's start is.

`"required"` and a named function are not left to the model: the output is held to a grammar
(a structured output, docs/design.md §17), as vLLM does it. A named function's output is its
arguments, an object valid against its `parameters`; "required" gives a JSON array of one or
more `{"name", "arguments"}` calls to the tools given. The calls are read from that JSON; only
an output cut off before it is complete has none (`ToolUse.unmet`), and that is an error, never
content passed off as a call.

Each reader serves whole responses and streams alike (a whole response is one push of its whole
text), so a streamed reply's content and calls add up to the whole reply's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from engine.messages import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # the arguments of a function without `parameters`


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True, slots=True)
class CallPiece:
    """A streamed part of call `index`: its first piece has the name, the rest add arguments."""

    index: int
    name: str | None
    arguments: str


class CallReader(Protocol):
    calls: list[ParsedCall]

    def push(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        """New content and call pieces for `text`; `final` flushes what was held."""
        ...


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request asks of tool calls: how to read them, and the grammar that forces one."""

    function: str | None  # tool_choice names this function
    required: bool  # tool_choice "required" or a named function
    max_calls: int | None  # 1 when parallel_tool_calls is false
    grammar: StructuredOutput | None

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolUse | None:
        """None when calls are not read: no tools, or tool_choice "none" (the text is content)."""
        if not body.tools or body.tool_choice == "none":
            return None
        max_calls = 1 if body.parallel_tool_calls is False else None
        if isinstance(body.tool_choice, NamedToolChoice):
            name = body.tool_choice.function.name
            (tool,) = [t for t in body.tools if t.function.name == name][:1]
            return cls(name, True, max_calls, _grammar(_parameters(tool)))
        if body.tool_choice == "required":
            return cls(None, True, max_calls, _grammar(_calls_schema(body.tools, max_calls)))
        return cls(None, False, max_calls, None)

    def reader(self) -> CallReader:
        if self.function is not None:
            return ArgumentsReader(self.function)
        if self.required:
            return CallListReader(self.max_calls)
        return HermesReader(self.max_calls)

    def unmet(self, reader: CallReader) -> str | None:
        """Why the finished reply does not satisfy tool_choice, or None when it does."""
        if self.required and not reader.calls:
            return "tool_choice requires a tool call and the output ended before one was complete"
        return None


def _grammar(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema), param="tool_choice")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def _calls_schema(tools: list[Tool], max_calls: int | None) -> dict[str, Any]:
    """One or more calls, each naming a tool given and holding arguments valid for it."""
    call = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


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


def _pieces(first: int, calls: list[ParsedCall]) -> list[CallPiece]:
    """Each call as OpenAI streams one: its name (with an empty start of its arguments), then its arguments."""
    return [
        piece
        for i, call in enumerate(calls, start=first)
        for piece in (CallPiece(i, call.name, ""), CallPiece(i, None, call.arguments))
    ]


def _partial_open(text: str) -> int:
    """Length of the longest tail of `text` that `OPEN` starts with."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)


@dataclass(slots=True)
class HermesReader:
    """tool_choice "auto": content and `<tool_call>` blocks, as the model chose to write them."""

    max_calls: int | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet known to be content or a call
    _inside: bool = False  # the buffer is the body of an open `<tool_call>`
    _space: str = ""  # trailing whitespace of the content, sent once more content follows

    def push(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        pieces: list[str] = []
        first = len(self.calls)
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
                self.calls.append(call)
            self._buffer, self._inside = ("" if end < 0 else self._buffer[end + len(CLOSE) :]), False
        if self._full():
            self._buffer = ""  # parallel_tool_calls false: nothing after the first call is returned
        return self._content("".join(pieces)), _pieces(first, self.calls[first:])

    def _full(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def _content(self, new: str) -> str:
        text = self._space + new
        body = text.rstrip()
        self._space = text[len(body) :]
        return body


@dataclass(slots=True)
class ArgumentsReader:
    """A named function: the whole output is its arguments, streamed as they come."""

    function: str
    calls: list[ParsedCall] = field(default_factory=list)
    _arguments: str = ""

    def push(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        pieces = [CallPiece(0, self.function, "")] if text and not self._arguments else []
        pieces += [CallPiece(0, None, text)] if text else []
        self._arguments += text
        if final and self._arguments:
            self.calls = [ParsedCall(self.function, self._arguments)]
        return "", pieces


@dataclass(slots=True)
class CallListReader:
    """tool_choice "required": a JSON array of calls, read once it is complete."""

    max_calls: int | None
    calls: list[ParsedCall] = field(default_factory=list)
    _text: str = ""

    def push(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        self._text += text
        if not final:
            return "", []
        try:
            value = json.loads(self._text)
        except json.JSONDecodeError:  # cut off by max_tokens or a stop string
            return "", []
        found = [parse_call(json.dumps(v)) for v in value] if isinstance(value, list) else []
        self.calls = [c for c in found if c is not None][: self.max_calls]
        return "", _pieces(0, self.calls)
