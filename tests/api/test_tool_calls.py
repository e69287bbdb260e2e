"""Tool calling: tools rendered into the prompt exactly as transformers' `apply_chat_template`
renders them (transformers is the oracle), the Hermes `<tool_call>` parser on whole and streamed
text, and the chat route's tool calls, whole and streamed, read by the `openai` package.

The shipped model is too small to call a tool on its own. For `tool_choice: "auto"` it is made
to write the calls' text by a `guided_regex` (a structured output that "auto" leaves free), so
the real engine, detokenizer, stop handling, parser and formatter carry them; "required" and a
named function hold its output to a grammar themselves.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from actors.ports import free_port
from api import Engine, RoundRobinRouter, create_app
from api.protocol import ChatMessage, Tool
from api.tokenization import chat_prompt
from api.tool_calls import HermesReader, ParsedCall, parse_call
from engine.config import Config
from engine.local import build_local_engine
from tests.api.conftest import deployed
from tests.api.test_text import byte_model
from training.build_tokenizer import build_tokenizer

TEMPLATE = (Path(__file__).parent / "templates" / "hermes_tools.jinja").read_text()
MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "a city; <b>not</b> a country"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TWO_CALLS = "Let me look.\n" + CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


# -- the parser ---------------------------------------------------------------------------


def parse_whole(text: str, max_calls: int | None = None) -> tuple[str, list[ParsedCall]]:
    reader = HermesReader(max_calls)
    content, _ = reader.push(text, final=True)
    return content, reader.calls


def parse_streamed(pieces: list[str], max_calls: int | None = None) -> tuple[str, list[ParsedCall]]:
    """Content and calls as a client rebuilds them from the streamed pieces."""
    reader = HermesReader(max_calls)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        new, found = reader.push(piece, final)
        # Before the end, a call's start is shown only with its end: a malformed block whole.
        assert final or "<tool_call" not in new or "</tool_call>" in content + new, "a call's start leaked"
        content += new
        for p in found:
            if p.name is not None:
                calls.append(ParsedCall(p.name, p.arguments))
            else:
                calls[p.index] = ParsedCall(calls[p.index].name, calls[p.index].arguments + p.arguments)
    assert calls == reader.calls
    return content, calls


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no call here", "no call here", []),
        (CALL, "", [ParsedCall("get_weather", '{"city": "Zürich"}')]),
        (
            TWO_CALLS,
            "Let me look.",
            [ParsedCall("get_weather", '{"city": "Zürich"}'), ParsedCall("get_time", "{}")],
        ),
        # A call cut off by the end of the output still counts; one that is not JSON stays text.
        ('<tool_call>{"name": "get_time", "arguments": {}}', "", [ParsedCall("get_time", "{}")]),
        ("a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b", []),
        ('<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
        (
            '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
            '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
        ("ends with <tool_ca", "ends with <tool_ca", []),
        ("x < y and <tool> tags", "x < y and <tool> tags", []),
    ],
)
def test_parser_whole_and_streamed_agree(text, content, calls):
    assert parse_whole(text) == (content, calls)
    # Streamed a character at a time, and in pieces of three: the same content and calls.
    assert parse_streamed(list(text)) == (content, calls)
    assert parse_streamed([text[i : i + 3] for i in range(0, len(text), 3)] or [""]) == (content, calls)


def test_parser_holds_back_only_what_may_start_a_call():
    reader = HermesReader()
    assert reader.push("Sure <tool", final=False) == ("Sure", [])  # the space waits for more content
    assert reader.push("s are here", final=False) == (" <tools are here", [])


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    content, calls = parse_whole(TWO_CALLS + " and more text", max_calls=1)
    assert (content, calls) == ("Let me look.", [ParsedCall("get_weather", '{"city": "Zürich"}')])
    assert parse_streamed(list(TWO_CALLS + " and more"), max_calls=1) == (content, calls)


def test_parse_call_normalizes_arguments_to_json_text():
    assert parse_call('{"name": "f", "arguments": {"a": [1, 2.5, null]}}') == ParsedCall("f", '{"a": [1, 2.5, null]}')
    assert parse_call('{"name": "f"}') == ParsedCall("f", "{}")
    assert parse_call("[1]") is None


# -- rendering, with transformers as the oracle ---------------------------------------------


def oracle(messages: list[dict], tools: list[dict] | None, **kw) -> str:
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|endoftext|>")
    return tok.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE, tokenize=False, **kw)


HISTORY = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Zürich, and the time?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 °C, rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


def as_oracle_input(messages: list[dict]) -> list[dict]:
    """The messages as a transformers user passes them: a call's arguments as an object."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize(
    "messages, tools, kw",
    [
        (HISTORY[:2], [WEATHER, TIME], {"add_generation_prompt": True}),
        (HISTORY, [WEATHER, TIME], {"add_generation_prompt": True}),
        (HISTORY[1:2], None, {"add_generation_prompt": True}),
        (HISTORY[:2], [WEATHER], {"add_generation_prompt": False}),
        (
            [*HISTORY[:2], {"role": "assistant", "content": "It is "}],
            [WEATHER],
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ],
)
def test_tools_and_history_render_as_transformers_renders_them(messages, tools, kw):
    model = byte_model(TEMPLATE)
    expected = oracle(as_oracle_input(messages), tools, **kw)
    ids = chat_prompt(
        model,
        [ChatMessage.model_validate(m) for m in messages],
        [Tool.model_validate(t) for t in tools] if tools else None,
        kw["add_generation_prompt"],
        kw.get("continue_final_message", False),
    )
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == expected
    if tools:
        assert json.dumps(WEATHER, ensure_ascii=False) in expected  # unescaped, keys in the client's order


# -- the chat route: the shipped model, its text held to a regex so that it writes calls ------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hermes") / "tiny-hybrid"
    shutil.copytree(MODEL_DIR, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def served(model_dir):
    """`served(fn)` runs `fn(openai_client)` against the app over a real engine on the shipped
    model (with the Hermes template), kept for the module."""
    cfg = Config(model=model_dir, served_model_name="tiny", device="cpu", num_kv_blocks=256, max_model_len=1024)
    loop = asyncio.new_event_loop()
    core, worker = build_local_engine(cfg)
    router = RoundRobinRouter([Engine.local("e0", core)])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg, router)), base_url="http://raypd/v1")
    client = openai.AsyncOpenAI(base_url="http://raypd/v1", api_key="x", http_client=http, max_retries=0)
    yield lambda fn: loop.run_until_complete(fn(client))
    loop.run_until_complete(http.aclose())
    loop.run_until_complete(router.close())
    loop.run_until_complete(core.close())
    worker.close()
    loop.close()


def _regex(text: str) -> str:
    """A regex that only `text` matches."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else ("\\n" if c == "\n" else c) for c in text)


MESSAGES = [{"role": "user", "content": "Weather in Zürich, and the time?"}]


async def whole_and_streamed(client: openai.AsyncOpenAI, **kw):
    whole = await client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **kw)
    return whole, [chunk async for chunk in stream]


def accumulate(chunks) -> tuple[str, dict[int, dict], str | None]:
    """What a client builds from the stream: content, the calls by index, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id is not None:
                    assert entry["id"] is None, "a call's id is sent once, first"
                    entry["id"], entry["name"] = call.id, call.function.name
                else:
                    assert entry["id"] is not None, "a call's arguments come after its id and name"
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def written(served, text: str, **kw):
    """Whole and streamed replies of the shipped model made to write `text` (a guided_regex,
    which tool_choice "auto" leaves free to use), read as tool calls or content."""
    body = {"guided_regex": _regex(text)}
    return served(lambda c: whole_and_streamed(c, max_tokens=len(text.encode()) + 1, extra_body=body, **kw))


def test_tool_calls_whole_and_streamed(served):
    whole, chunks = written(served, TWO_CALLS, tools=[WEATHER, TIME])
    message = whole.choices[0].message
    assert message.content == "Let me look." and whole.choices[0].finish_reason == "tool_calls"
    got = [(c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert got == [("function", "get_weather", {"city": "Zürich"}), ("function", "get_time", {})]
    assert len({c.id for c in message.tool_calls}) == 2
    content, calls, finish = accumulate(chunks)
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_without_tools_or_with_tool_choice_none_the_text_is_content(served):
    for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        whole, chunks = written(served, TWO_CALLS, **kw)
        assert whole.choices[0].message.content == TWO_CALLS and whole.choices[0].message.tool_calls is None
        assert accumulate(chunks) == (TWO_CALLS, {}, "stop")


def test_a_malformed_call_stays_content(served):
    text = 'Hm. <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    whole, chunks = written(served, text, tools=[WEATHER])
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "stop"
    assert accumulate(chunks) == (text, {}, "stop")


# -- tool_choice "required" and a named function: the shipped model, held to a grammar -----------

UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
VALID = {"set_unit": [{"unit": "c"}, {"unit": "f"}], "get_time": [{}]}


def forced(served, **kw):
    return served(lambda c: whole_and_streamed(c, tools=[UNIT, CLOCK], max_tokens=80, temperature=0, **kw))


def test_a_named_function_is_called_with_arguments_valid_for_it(served):
    whole, chunks = forced(served, tool_choice={"type": "function", "function": {"name": "set_unit"}})
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "set_unit" and json.loads(call.function.arguments) in VALID["set_unit"]
    assert whole.choices[0].message.content is None and whole.choices[0].finish_reason == "tool_calls"
    content, calls, finish = accumulate(chunks)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("set_unit", call.function.arguments)]


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_calls_to_the_tools_given(served, parallel):
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    whole, chunks = forced(served, tool_choice="required", **kw)
    calls = whole.choices[0].message.tool_calls
    assert calls and all(json.loads(c.function.arguments) in VALID[c.function.name] for c in calls)
    assert parallel is None or len(calls) == 1
    assert whole.choices[0].finish_reason == "tool_calls"
    _, streamed, finish = accumulate(chunks)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_forced_call_cut_off_by_max_tokens(served):
    async def fn(client):
        named = await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=[UNIT],
            tool_choice={"type": "function", "function": {"name": "set_unit"}},
            max_tokens=3,
        )
        with pytest.raises(openai.InternalServerError) as required:
            await client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=[UNIT], tool_choice="required", max_tokens=3
            )
        return named, required.value

    named, required = served(fn)
    # As OpenAI: a named call cut off keeps what was written, with finish_reason "length".
    assert named.choices[0].finish_reason == "length"
    assert '{"unit": "c"}'.startswith(named.choices[0].message.tool_calls[0].function.arguments[:3])
    assert required.body["code"] == "tool_call_missing"


def test_a_forced_call_and_another_structured_output_are_a_400(served):
    async def fn(client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                tools=[UNIT],
                tool_choice="required",
                response_format={"type": "json_object"},
            )
        return e.value.body

    assert served(fn)["param"] == "tool_choice"


def test_forced_calls_over_http_under_pd(ray_cluster, model_dir):
    """Forced calls through `python -m serve`'s deployment on Ray, 1P1D, over real HTTP: the
    grammar travels with the request to the engines that sample."""
    cfg = Config(
        model=model_dir,
        served_model_name="tiny",
        device="cpu",
        num_kv_blocks=256,
        max_model_len=1024,
        worker_threads=1,
        port=free_port(),
        prefill=1,
        decode=1,
    )
    kw = {"tools": [UNIT, CLOCK], "max_tokens": 80, "temperature": 0}
    with deployed(cfg) as dep:
        client = openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0)
        named = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tool_choice={"type": "function", "function": {"name": "set_unit"}}, **kw
        )
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tool_choice="required", stream=True, **kw
        )
        required = accumulate(list(stream))
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "set_unit" and json.loads(call.function.arguments) in VALID["set_unit"]
    _, calls, finish = required
    assert finish == "tool_calls" and calls
    assert all(json.loads(c["arguments"]) in VALID[c["name"]] for c in calls.values())
