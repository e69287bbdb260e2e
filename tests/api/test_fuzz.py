"""Bad input over real HTTP: the 1P1D server with the shipped model answers every malformed
request with a 4xx in OpenAI's error shape, never a 5xx, and serves as before afterwards.

Issue 8, finding 7: one request (`"top_k": 9223372036854775808`) once killed the decode engine
for good. Here every field of both generation routes gets, in seeded random combinations,
values it must refuse: wrong JSON types, integers up to 2**64 and beyond, negatives, NaN and
Infinity (written as the raw JSON tokens Python's `json` reads), huge and unpaired-surrogate
strings, nulls where a value is required, wrong nesting and bodies that are no object at all.
Values at the edge of each range must still be served.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.ports import free_port
from api.limits import MAX_BODY_BYTES
from api.protocol import MAX_PROMPTS, MAX_TEXT_CHARS
from engine.config import Config
from tests.api.conftest import deployed
from tests.api.test_server import wait_blocks_free

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
NAME = "tiny-hybrid"
CONTEXT = 512
VOCAB = 258  # the shipped byte-level tokenizer: 256 bytes, EOS, pad
NUM_FUZZED = 400
SEED = 8
TIMEOUT_S = 30.0  # per request: a hang fails the test instead of stalling it
README_EXAMPLE = {"model": NAME, "prompt": "ab=381;qe=027;zt=950;?qe=", "max_tokens": 4, "temperature": 0}

NAN, INF = float("nan"), float("inf")
SURROGATE = "\ud800"  # json.dumps writes it as the escape "\ud800", which json.loads reads back unpaired
HUGE = "x" * (MAX_TEXT_CHARS + 1)  # beyond the schema's bound
LONG = ("ab=381;" * 150_000)[: 10**6]  # a million characters: within the bound, far beyond the context

NOT_INT = ["1", "", SURROGATE, 1.5, 2.0, NAN, INF, -INF, True, False, [], [1], {}, {"a": 1}]
NOT_NUMBER = ["0.5", "", SURROGATE, True, False, [], [0.5], {}, {"a": 1}]
NOT_BOOL = [0, 1, 1.5, NAN, "true", "false", "", [], [True], {}, {"a": True}]
NOT_STRING = [0, 1.5, NAN, INF, True, [], ["a"], {}, {"a": "b"}]
BEYOND_INT64 = [2**63, 2**64, 2**64 + 1, -(2**63) - 1, -(2**64), 10**30]
TOO_MANY_TOKENS = [CONTEXT, 2**31, *BEYOND_INT64]
# JSON schemas xgrammar cannot compile (worker/grammar.py).
BAD_SCHEMAS: list[Any] = [
    {"type": "foo"},
    {"type": "object", "properties": 5},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"enum": []},
    {"$ref": "#/nowhere"},
    [],
]


def _message(**fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "ab=381;?ab=", **fields}]


# For each field of each route: values it must refuse, whatever else the request holds.
COMMON: dict[str, list[Any]] = {
    "model": [*NOT_STRING, "gpt-9", "x" * 300, SURROGATE],
    "max_tokens": [*NOT_INT, 0, -1, *TOO_MANY_TOKENS],
    "temperature": [*NOT_NUMBER, NAN, INF, -INF, -0.01, 2.01, 1e308, -1e308, *BEYOND_INT64],
    "top_p": [*NOT_NUMBER, NAN, INF, -INF, 0, 0.0, -0.5, 1.01, *BEYOND_INT64],
    "top_k": [*NOT_INT, -2, 2**31, 2**63 - 1, *BEYOND_INT64],
    "seed": [*NOT_INT, *BEYOND_INT64],
    "stop": [
        0,
        1.5,
        NAN,
        True,
        {},
        {"a": "b"},
        "",
        [""],
        ["a"] * 5,
        "x" * 257,
        ["x" * 257],
        [1],
        [None],
        [["a"]],
        SURROGATE,
        [SURROGATE],
    ],
    "n": [*NOT_INT, 0, -1, 17, *BEYOND_INT64],
    "stream": NOT_BOOL,
    "stream_options": [{"include_usage": True}, {}, "yes", 1, [], [{"include_usage": True}]],  # stream is false
    "ignore_eos": NOT_BOOL,
    "user": [*NOT_STRING, "x" * 300, SURROGATE],
    "safety_identifier": [*NOT_STRING, "x" * 300],
    "prompt_cache_key": [*NOT_STRING, "x" * 300],
    "metadata": ["x", 1, [], {"a": 1}, {"x" * 300: "v"}, {f"k{i}": "v" for i in range(17)}],
    "store": NOT_BOOL,
    "service_tier": ["", "fast", 1, True],
    "frobnicate": [1, None, "x"],  # in neither OpenAI's nor vLLM's schema: refused by name
    "best_of": [1, 2],  # OpenAI's, not implemented: refused by name
    "presence_penalty": [*NOT_NUMBER, NAN, INF, -INF, -2.01, 2.01, *BEYOND_INT64],
    "frequency_penalty": [*NOT_NUMBER, NAN, INF, -INF, -2.01, 2.01, *BEYOND_INT64],
    "repetition_penalty": [*NOT_NUMBER, NAN, INF, -INF, 0, 0.0, -1.0, -(2**64)],
    "min_p": [*NOT_NUMBER, NAN, INF, -INF, -0.01, 1.01, *BEYOND_INT64],
    "min_tokens": [*NOT_INT, -1, 3, *BEYOND_INT64],  # 3 is beyond the base body's max_tokens
    "stop_token_ids": [*NOT_INT[:-5], 1, [-1], [VOCAB], [2**64], [1.5], [True], ["1"], [None], [1] * 257],
    "logit_bias": [
        *NOT_STRING[:-2],
        [],
        {"x": 1},
        {"-1": 1},
        {"1.5": 1},
        {str(VOCAB): 1},
        {"1" * 11: 1},
        {"1": 100.5},
        {"1": -101},
        {"1": NAN},
        {"1": INF},
        {"1": "1"},
        {"1": True},
        {"1": None},
        {str(i): 1 for i in range(1025)},
    ],
    # Structured outputs: wrong shapes are refused by the API, grammars that do not compile by
    # the worker, before the response starts (a 400 either way).
    "response_format": [
        *NOT_STRING,
        "json_object",
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}},
        *({"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in BAD_SCHEMAS),
    ],
    "guided_json": [0, True, [], "", "{", SURROGATE, *BAD_SCHEMAS, *map(json.dumps, BAD_SCHEMAS)],
    "guided_regex": [*NOT_STRING, "", "((", "[a-", "a{2,1}", SURROGATE],
    "guided_choice": [*NOT_STRING, "a", [""], [1], ["a", None], ["a"] * 257, [SURROGATE]],
    "guided_grammar": [*NOT_STRING, "", "x", "root ::= ", 'root ::= "a" |', SURROGATE],
    "structured_outputs": [
        *NOT_STRING,
        {"regex": "a", "choice": ["b"]},
        {"yaml": "a"},
        {"json_object": False},
        {"regex": "(("},
        {"json": {"type": "foo"}},
    ],
}
COMPLETION: dict[str, list[Any]] = {
    **COMMON,
    "prompt": [
        None,
        5,
        1.5,
        NAN,
        True,
        {},
        {"text": "a"},
        "",
        [],
        [""],
        [[]],
        [-1],
        [1.5],
        [True],
        [None],
        [1, "a"],
        ["a", 1],
        [[[1]]],
        [[1], []],
        [[1, -1]],
        [VOCAB],
        [2**64],
        [[2**64]],
        ["a"] * 65,
        SURROGATE,
        [SURROGATE],
        HUGE,
        LONG,
        [1] * CONTEXT,
    ],
    "logprobs": [*NOT_INT, -1, 6, *BEYOND_INT64],
    "echo": NOT_BOOL,
    "prompt_logprobs": [*NOT_INT, -1, 21, *BEYOND_INT64],
}
CHAT: dict[str, list[Any]] = {
    **COMMON,
    "messages": [
        None,
        5,
        "hi",
        {},
        _message()[0],
        [],
        [None],
        ["hi"],
        [_message()],
        [{"content": "x"}],
        [{"role": "robot", "content": "x"}],
        [{"role": 5, "content": "x"}],
        _message(content=5),
        _message(content={"type": "text", "text": "x"}),
        _message(content=[{"type": "text"}]),
        _message(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
        _message(content=[{"type": "text", "text": 5}]),
        _message(content=[{"text": "x"}]),
        _message(content=["x"]),
        _message(name=5),
        _message(content=SURROGATE),
        _message(content=HUGE),
        _message(content=LONG),
    ],
    "max_completion_tokens": [*NOT_INT, 0, -1, *TOO_MANY_TOKENS],
    "logprobs": NOT_BOOL,
    "top_logprobs": [*NOT_INT, -1, 21, *BEYOND_INT64],
    "tools": [
        5,
        "x",
        {},
        [{}],
        [{"type": "code"}],
        [{"type": "function"}],
        [{"type": "function", "function": {"name": ""}}],
        [{"type": "function", "function": {"name": "a b"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
        [{"type": "function", "function": {"name": "f", "strict": True}}],
        [{"type": "function", "function": {"name": "f"}}],  # the shipped model's template shows no tools
    ],
    "tool_choice": [
        "auto",
        "required",
        "any",
        5,
        {},
        {"type": "function"},
        {"type": "function", "function": {"name": "f"}},
    ],
    "parallel_tool_calls": NOT_BOOL,
    "add_generation_prompt": NOT_BOOL,
    "continue_final_message": [*NOT_BOOL, True],  # true needs add_generation_prompt false
}
TOKENIZE: dict[str, list[Any]] = {
    "model": COMMON["model"],
    "prompt": [5, 1.5, NAN, True, {}, [], ["a"], [1], SURROGATE, HUGE],
    "messages": [m for m in CHAT["messages"] if m is not None],  # with a prompt, or not messages at all
    "add_special_tokens": NOT_BOOL,
    "add_generation_prompt": [*NOT_BOOL, True],  # with a prompt: chat only
    "continue_final_message": [*NOT_BOOL, False],
    "tools": [5, [{}], [{"type": "function", "function": {"name": "f"}}]],
    "return_token_strs": NOT_BOOL,
    "truncate_prompt_tokens": [1, 0],  # vLLM's, not implemented: refused by name
}
DETOKENIZE: dict[str, list[Any]] = {
    "model": COMMON["model"],
    "tokens": [None, 5, "a", {}, [-1], [VOCAB], [2**64], [True], [1.5], ["a"], [[1]], [NAN], [SURROGATE]],
    "skip_special_tokens": [True, False],  # not implemented: refused by name
}
ROUTES: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
    "/v1/completions": ({"model": NAME, "prompt": "ab=381;?ab=", "max_tokens": 2, "temperature": 0}, COMPLETION),
    "/v1/chat/completions": ({"model": NAME, "messages": _message(), "max_tokens": 2, "temperature": 0}, CHAT),
    "/tokenize": ({"model": NAME, "prompt": "ab=381;?ab="}, TOKENIZE),
    "/detokenize": ({"model": NAME, "tokens": [97, 98]}, DETOKENIZE),
}
MISSING, NOT_AN_OBJECT = "<missing required field>", "<body not an object>"
NON_OBJECTS = [[], ["x"], "x", 5, NAN, None, True]


def fuzzed(rng: random.Random, i: int) -> tuple[str, set[str], Any]:
    """The i-th request: its route, the fields it breaks and its body. Each field of each route
    is the first broken in turn; up to two more are broken at random."""
    path = list(ROUTES)[i % len(ROUTES)]
    base, spec = ROUTES[path]
    targets = [*spec, MISSING, NOT_AN_OBJECT]
    target = targets[(i // len(ROUTES)) % len(targets)]
    if target == NOT_AN_OBJECT:
        return path, {target}, rng.choice([*NON_OBJECTS, [base]])
    body = dict(base)
    broken = {target, *rng.sample(list(spec), rng.randint(0, 2))}
    for field in sorted(broken):  # sorted: the same seed gives the same bodies
        if field == MISSING:
            del body[next(k for k in ("prompt", "messages", "tokens") if k in body)]
        else:
            body[field] = rng.choice(spec[field])
    return path, broken, body


@pytest.fixture(scope="module")
def server(ray_cluster):
    cfg = Config(
        model=str(MODEL_DIR),
        served_model_name=NAME,
        device="cpu",
        num_kv_blocks=256,
        max_model_len=CONTEXT,
        max_num_seqs=32,
        worker_threads=1,
        port=free_port(),
        prefill=1,
        decode=1,
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """The body as JSON text: NaN and Infinity as bare tokens, integers at full width."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The response's OpenAI error object, asserting its shape."""
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, r.text
    assert isinstance(error["message"], str) and error["message"], r.text
    # The path in the message is the client's (fields, indices), not pydantic's union members.
    assert not any(tag in error["message"] for tag in ("list[", "function-", "constrained-")), r.text
    return error


def completes(http: httpx.Client, path: str, body: dict[str, Any]) -> str:
    """The whole text of a request that must succeed (streamed or not), asserting no error."""
    r = post(http, path, body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), r.text
    return "".join(
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
        for c in map(json.loads, events[:-1])
        if c["choices"]
    )


def test_finding_7_top_k_beyond_int64_is_a_400_and_the_engine_lives(http):
    # Sampled (the default temperature), so the decode engine's sampler would see top_k.
    body = {"model": NAME, "prompt": README_EXAMPLE["prompt"], "top_k": 9223372036854775808}
    r = post(http, "/v1/completions", body)
    assert r.status_code == 400 and error_of(r)["param"] == "top_k", r.text
    assert completes(http, "/v1/completions", README_EXAMPLE).startswith("027")


# Requests the API once answered wrongly, each now a 400 naming the field.
REGRESSIONS = [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),  # a 500: the tokenizer raised TypeError
    ("/v1/completions", {"model": SURROGATE}, "model"),  # a 500: the 404's body could not be encoded
    ("/v1/chat/completions", {"messages": _message(content="a" + SURROGATE)}, "messages"),  # a 500
    ("/v1/completions", {"prompt": [True, 1]}, "prompt"),  # served as token ids [1, 1]
    ("/v1/completions", {"stream": 1}, "stream"),  # taken as true
    ("/v1/completions", {"max_tokens": "4"}, "max_tokens"),  # taken as 4
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # ignored
    ("/v1/completions", {"prompt": ["a"] * MAX_PROMPTS, "n": 16}, "n"),  # 1024 engine requests: a 503
    ("/v1/completions", {"prompt": LONG}, "prompt"),  # a million token ids shipped to the engines
    ("/v1/chat/completions", {"max_completion_tokens": CONTEXT}, "max_completion_tokens"),  # named max_tokens
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),  # any number of stop strings
    # Nested fields the fuzzed requests reach only behind another broken one.
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    (
        "/v1/chat/completions",
        {"messages": [*_message(), {"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages",
    ),
]


@pytest.mark.parametrize("path, fields, param", REGRESSIONS, ids=[f"{p}-{f}" for _, f, p in REGRESSIONS])
def test_requests_once_answered_wrongly_are_400_naming_the_field(http, path, fields, param):
    body = {**README_EXAMPLE, **fields}
    if path == "/v1/chat/completions":
        body.pop("prompt")
        body.setdefault("messages", _message())
    r = post(http, path, body)
    assert r.status_code == 400 and error_of(r)["param"] == param, r.text


def test_openapi_states_the_real_bounds(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    fields = schemas["CompletionRequest"]["properties"]

    def bounds(name: str) -> dict[str, Any]:
        (number,) = [s for s in fields[name]["anyOf"] if s.get("type") in ("integer", "number")]
        return {k: v for k, v in number.items() if k != "type"}

    assert bounds("top_k") == {"minimum": -1, "maximum": 2**31 - 1}
    assert bounds("temperature") == {"minimum": 0, "maximum": 2}
    assert bounds("top_p") == {"exclusiveMinimum": 0, "maximum": 1}
    assert bounds("n") == {"minimum": 1, "maximum": 16}
    assert bounds("max_tokens") == {"minimum": 0}  # 0 only with echo
    assert bounds("logprobs") == {"minimum": 0, "maximum": 5}
    assert bounds("prompt_logprobs") == {"minimum": 0, "maximum": 20}
    assert bounds("presence_penalty") == bounds("frequency_penalty") == {"minimum": -2, "maximum": 2}
    assert bounds("repetition_penalty") == {"exclusiveMinimum": 0}
    assert bounds("min_p") == {"minimum": 0, "maximum": 1}
    assert bounds("min_tokens") == {"minimum": 0}
    (stop_list,) = [s for s in fields["stop"]["anyOf"] if s.get("type") == "array"]
    assert stop_list["maxItems"] == 4 and stop_list["items"]["minLength"] == 1
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1


EDGES = [
    ("/v1/completions", {"top_k": 2**31 - 1, "temperature": 1.0}),  # beyond the vocabulary: no filtering
    ("/v1/completions", {"top_k": -1, "temperature": 1.0}),
    ("/v1/completions", {"top_k": 1, "temperature": 2}),
    ("/v1/completions", {"seed": 2**63 - 1, "n": 2, "temperature": 1.0}),  # the second choice's seed wraps
    ("/v1/completions", {"seed": -(2**63), "temperature": 1.0, "top_p": 1e-300}),
    ("/v1/completions", {"n": 16, "max_tokens": 1}),
    ("/v1/completions", {"stop": ["x" * 256, ";", "=", "\U0001f600"], "logprobs": 5}),
    ("/v1/completions", {"prompt": [[VOCAB - 1, 0], [97]], "max_tokens": 2}),
    ("/v1/completions", {"max_tokens": CONTEXT - 25}),  # the README prompt is 25 tokens
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"max_completion_tokens": 3, "logprobs": True, "top_logprobs": 20}),
    ("/v1/chat/completions", {"stream": True, "stream_options": None, "ignore_eos": False, "user": "u"}),
    (
        "/v1/chat/completions",
        {
            "metadata": {f"k{i}": "v" * 512 for i in range(16)},
            "store": True,
            "service_tier": "flex",
            "tool_choice": "none",
        },
    ),
    ("/v1/chat/completions", {"add_generation_prompt": False, "continue_final_message": True}),
    ("/v1/completions", {"guided_choice": [str(i) for i in range(255)] + ["\U0001f600"], "temperature": 1.0}),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a" * 64, "schema": {}, "strict": False}}},
    ),
    ("/v1/completions", {"response_format": {"type": "text"}, "stream": True}),
    ("/v1/completions", {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 1e-30}),
    ("/v1/completions", {"repetition_penalty": 1e30, "temperature": 1.0, "min_p": 1.0, "top_k": 1}),
    ("/v1/completions", {"logit_bias": {str(VOCAB - 1): 100, "0": -100}, "stream": True, "logprobs": 0}),
    ("/v1/completions", {"min_tokens": 4, "stop_token_ids": [VOCAB - 1, 0, 0], "temperature": 1.0}),
    ("/v1/completions", {"echo": True, "logprobs": 5, "max_tokens": 0, "prompt_logprobs": 20, "n": 2}),
    ("/v1/completions", {"echo": True, "prompt": [[VOCAB - 1], [0, 1]], "stream": True, "logprobs": 1}),
    ("/v1/chat/completions", {"presence_penalty": -2, "logit_bias": {}, "stop_token_ids": [], "min_tokens": 0}),
]


@pytest.mark.parametrize("path, fields", EDGES, ids=[json.dumps(f)[:60] for _, f in EDGES])
def test_values_at_the_edge_of_each_range_are_served(http, path, fields):
    base = dict(README_EXAMPLE)
    if path == "/v1/chat/completions":
        base["messages"] = [{"role": "user", "content": base.pop("prompt")}]
    completes(http, path, {**base, "max_tokens": 4, **fields})


RAW_BODIES = [
    (b'{"model": "tiny-hybrid", "prompt": ', "application/json"),  # truncated
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "application/json"),  # not UTF-8
    (b"", "application/json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),  # deeper than any parser recursion
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "application/json"),  # beyond int parsing
    (b'{"prompt": "a", "prompt": 5}', "application/json"),  # the last duplicate wins
    (b"prompt=a&max_tokens=2", "application/x-www-form-urlencoded"),
    (json.dumps(README_EXAMPLE).encode(), "text/plain"),
]


def test_a_body_beyond_the_limit_is_413(http):
    r = http.post("/v1/completions", content=b" " * (MAX_BODY_BYTES + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    error_of(r)


def test_wrong_method_and_path_get_openai_errors(http):
    for r, status in ((http.get("/v1/completions"), 405), (http.post("/v1/nothing", json={}), 404)):
        assert r.status_code == status, r.text
        error_of(r)


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("raw, content_type", RAW_BODIES, ids=[f"raw{i}" for i in range(len(RAW_BODIES))])
def test_bodies_that_are_no_request_are_400(http, path, raw, content_type):
    r = http.post(path, content=raw, headers={"Content-Type": content_type})
    assert r.status_code == 400, r.text
    error_of(r)


def test_fuzzed_requests_get_4xx_and_the_server_serves_on(server, http):
    rng = random.Random(SEED)
    wrong = []
    for i in range(NUM_FUZZED):
        path, broken, body = fuzzed(rng, i)
        r = post(http, path, body)
        if not 400 <= r.status_code < 500:
            wrong.append((path, sorted(broken), json.dumps(body)[:300], r.status_code, r.text[:300]))
            continue
        error = error_of(r)
        if len(broken) == 1 and broken <= set(ROUTES[path][1]):  # one broken field: the error names it
            assert error["param"] == next(iter(broken)), (json.dumps(body)[:300], r.text)
    assert not wrong, "\n".join(map(str, wrong))
    assert http.get("/health").status_code == 200
    assert completes(http, "/v1/completions", README_EXAMPLE).startswith("027")
    wait_blocks_free(server, within_s=10.0)
