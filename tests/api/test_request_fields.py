"""Which request fields the server takes: a field of OpenAI's or vLLM's schema that raypd does
not implement, or one in neither, is a 400 naming it; the fields that change nothing the client
gets are accepted and change nothing. The app runs in-process over the shipped model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from api import Engine, RoundRobinRouter, create_app
from engine.config import Config
from engine.local import build_local_engine

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
PROMPT = "ab=381;qe=027;zt=950;?qe="
BODIES = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0},
}

# Fields of OpenAI's and vLLM's requests that raypd does not implement, each with a value a
# client would send. Ignoring any of them would change what the client gets.
NOT_IMPLEMENTED = {
    "best_of": 2,
    "suffix": "x",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "truncate_prompt_tokens": 8,
    "allowed_token_ids": [97],
    "bad_words": ["a"],
    "priority": 1,
    "request_id": "mine",
    "cache_salt": "s",
    "kv_transfer_params": {"do_remote_decode": True},
    "return_tokens_as_token_ids": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {},
    "frobnicate": 1,  # in neither schema
}
# Accepted and ignored: who the user is, tags, storage, billing and cache-routing hints.
NO_BEHAVIOUR = {
    "user": "u-1",
    "safety_identifier": "u-1",
    "prompt_cache_key": "conversation-7",
    "metadata": {"team": "eval"},
    "store": False,
    "service_tier": "auto",
}


@pytest.fixture(scope="module")
def post():
    """`post(path, body)` to the app over one engine, kept for the module."""
    cfg = Config(
        model=str(MODEL_DIR), served_model_name="tiny-hybrid", device="cpu", num_kv_blocks=128, max_model_len=256
    )
    loop = asyncio.new_event_loop()
    core, worker = build_local_engine(cfg)
    router = RoundRobinRouter([Engine.local("e0", core)])
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg, router)), base_url="http://raypd")
    yield lambda path, body: loop.run_until_complete(client.post(path, json=body))
    loop.run_until_complete(client.aclose())
    loop.run_until_complete(router.close())
    loop.run_until_complete(core.close())
    worker.close()
    loop.close()


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, r.text
    return error["message"]


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("field", list(NOT_IMPLEMENTED))
def test_a_field_raypd_does_not_implement_is_a_400_naming_it(post, path, field):
    message = refused(post(path, {**BODIES[path], field: NOT_IMPLEMENTED[field]}), field)
    assert message == f"`{field}` is not supported by this server"


@pytest.mark.parametrize(
    "path, fields, param, where",
    [
        (
            "/v1/completions",
            {"stream": True, "stream_options": {"include_obfuscation": False}},
            "stream_options",
            "stream_options.include_obfuscation",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "refusal": None}]},
            "messages",
            "messages.0.refusal",
        ),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
            "tools",
            "tools.0.function.examples",
        ),
    ],
)
def test_a_nested_unknown_field_is_named_by_its_path(post, path, fields, param, where):
    assert refused(post(path, {**BODIES[path], **fields}), param) == f"`{where}` is not supported by this server"


def test_strict_function_calling_is_refused(post):
    tools = [{"type": "function", "function": {"name": "f", "strict": True}}]
    refused(post("/v1/chat/completions", {**BODIES["/v1/chat/completions"], "tools": tools}), "tools")


@pytest.mark.parametrize("path", list(BODIES))
def test_fields_without_behaviour_are_accepted_and_change_nothing(post, path):
    plain = post(path, BODIES[path])
    given = post(path, {**BODIES[path], **NO_BEHAVIOUR})
    assert plain.status_code == given.status_code == 200, given.text

    def text(r: httpx.Response) -> str:
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert text(given) == text(plain) and given.json()["usage"] == plain.json()["usage"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages",
        ),
        ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # its template leaves tools out
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(post, fields, param):
    refused(post("/v1/chat/completions", {**BODIES["/v1/chat/completions"], **fields}), param)
