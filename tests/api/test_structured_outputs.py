"""Structured outputs over real HTTP with the `openai` package, colocated and 1P1D, on the
shipped model: seeded sampled outputs that all validate against their JSON schema, each field
that asks for a grammar, streaming, cut-off outputs that are still a prefix of the grammar, and
the 400s for what cannot be a grammar. Then a request with a grammar resumed on another engine
(api/migration.py) after its own failed mid-output."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import xgrammar as xgr

from actors.ports import free_port
from engine.config import Config
from engine.messages import SamplingParams, StructuredOutput
from tests.api.conftest import deployed
from tests.api.test_migration import cut_after_three
from worker.grammar import GrammarCompiler

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
NAME = "tiny-hybrid"
EOS = 256
NUM_SEEDED = 50
PROMPTS = ["ab=381;qe=027;zt=950;?qe=", "gs=047;tl=517;rf=447;?rf=", "du=947;mk=632;kz=528;ug=369;?ug="]
SCHEMA = {
    "type": "object",
    "properties": {
        "key": {"type": "string", "pattern": "^[a-z]{2}$"},
        "value": {"type": "integer", "minimum": 0, "maximum": 999},
        "found": {"type": "boolean"},
        "notes": {"type": "array", "items": {"enum": ["exact", "guess", "none"]}, "maxItems": 3},
    },
    "required": ["key", "value", "found", "notes"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "lookup", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module", params=[0, 1], ids=["colocated", "1P1D"])
def server(ray_cluster, request):
    cfg = Config(
        model=str(MODEL_DIR),
        served_model_name=NAME,
        device="cpu",
        num_kv_blocks=256,
        max_model_len=256,
        max_num_seqs=32,
        worker_threads=1,
        port=free_port(),
        prefill=request.param,
        decode=1,
    )
    with deployed(cfg) as dep:
        yield dep


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def compiler():
    c = GrammarCompiler(str(MODEL_DIR), 258, EOS)
    yield c
    c.close()


def _is_prefix(compiler: GrammarCompiler, spec: StructuredOutput, text: str) -> bool:
    """Whether `text` is where the grammar can be after some tokens (a cut-off output)."""
    return bool(xgr.GrammarMatcher(compiler.get(spec)).accept_string(text))


def seeded_schema_request(client: openai.OpenAI, seed: int):
    """One sampled chat request held to SCHEMA, its prompt and seed chosen by `seed`."""
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": PROMPTS[seed % len(PROMPTS)]}],
        max_tokens=96,
        temperature=1.0,
        seed=seed,
        response_format=RESPONSE_FORMAT,
    )


def test_seeded_sampled_chat_outputs_all_validate(client):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda seed: seeded_schema_request(client, seed), range(NUM_SEEDED)))
    for r in responses:
        choice = r.choices[0]
        # The schema bounds every field, so every output ends well within max_tokens, on EOS.
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({r.choices[0].message.content for r in responses}) > 1  # sampled, not one fixed answer
    again = seeded_schema_request(client, 7)
    assert again.choices[0].message.content == responses[7].choices[0].message.content  # seeded


def test_every_field_that_asks_for_a_grammar(client, compiler):
    regex = r"[a-z]{2}=[0-9]{3}"
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    any_object = StructuredOutput("json_object")

    def valid(text: str) -> bool:
        return jsonschema.validate(json.loads(text), SCHEMA) is None

    def is_object(text: str) -> bool:
        return isinstance(json.loads(text), dict)

    # (extra fields, the grammar, what a finished output is); `any_object` is unbounded: the toy
    # model may fill its budget with one key, so a cut-off output is checked as a prefix.
    cases = [
        ({"response_format": {"type": "json_object"}}, any_object, is_object),
        ({"response_format": RESPONSE_FORMAT}, schema, valid),
        ({"guided_json": SCHEMA}, schema, valid),
        ({"guided_json": json.dumps(SCHEMA)}, schema, valid),
        ({"guided_regex": regex}, StructuredOutput("regex", regex), lambda t: re.fullmatch(regex, t)),
        (
            {"guided_choice": ["yes", "no", "two words"]},
            StructuredOutput("grammar", 'root ::= "yes" | "no" | "two words"'),
            lambda t: t in {"yes", "no", "two words"},
        ),
        (
            {"guided_grammar": 'root ::= "k=" [0-9]{1,4} ";"'},
            StructuredOutput("grammar", 'root ::= "k=" [0-9]{1,4} ";"'),
            lambda t: re.fullmatch(r"k=[0-9]{1,4};", t),
        ),
        ({"structured_outputs": {"regex": regex}}, StructuredOutput("regex", regex), lambda t: re.fullmatch(regex, t)),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            StructuredOutput("grammar", 'root ::= "a" | "b"'),
            lambda t: t in {"a", "b"},
        ),
        ({"structured_outputs": {"json": SCHEMA}}, schema, valid),
        ({"structured_outputs": {"json_object": True}}, any_object, is_object),
    ]
    for fields, spec, check in cases:
        for seed in range(2):
            r = client.completions.create(
                model=NAME, prompt=PROMPTS[seed], max_tokens=64, temperature=0.7, seed=seed, extra_body=fields
            )
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            if reason == "length" and spec is any_object:
                assert _is_prefix(compiler, spec, text), (fields, text)
                continue
            assert reason == "stop", (fields, text)
            assert check(text), (fields, text)


def test_a_streamed_output_keeps_to_its_schema(client):
    for seed in range(3):
        chunks = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": PROMPTS[1]}],
            max_tokens=96,
            temperature=0.8,
            seed=seed,
            response_format=RESPONSE_FORMAT,
            stream=True,
        )
        parts, reasons = [], []
        for chunk in chunks:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                reasons.append(c.finish_reason)
        assert reasons[-1] == "stop"
        jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def test_an_output_cut_by_max_tokens_is_a_prefix_of_the_grammar(client, compiler):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    for seed, max_tokens in ((1, 5), (2, 11), (3, 17)):
        r = client.completions.create(
            model=NAME,
            prompt=PROMPTS[2],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": RESPONSE_FORMAT},
        )
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "length" and text.startswith("{")
        assert _is_prefix(compiler, spec, text), text
        assert not _is_prefix(compiler, spec, text + "}}")  # the check can fail


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
        ({"extra_body": {"guided_regex": "(("}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"yaml": "a"}}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 3}}, "min_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_what_cannot_be_a_grammar_is_a_400_naming_its_field(client, fields, param, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, stream=stream, **fields
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    # and the server serves on
    ok = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
    assert ok.choices[0].text == "02"  # the toy model's answer is "027"


def test_a_request_with_a_grammar_resumed_on_another_engine_goes_on_exactly():
    """Engine e1 fails after three outputs of a seeded structured request; e0 gets the prompt
    plus those outputs, replays them into the grammar, and the client's tokens are those of an
    undisturbed run."""
    cfg = Config(model=str(MODEL_DIR), device="cpu", num_kv_blocks=128, max_model_len=256, worker_threads=1)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    sampling = SamplingParams(max_tokens=96, temperature=1.0, seed=5, structured=spec)
    prompt = list(PROMPTS[0].encode())

    whole, cut, resumed = cut_after_three(cfg, prompt, sampling)
    tokens = [t for o in cut for t in o.new_token_ids]
    assert resumed >= 1
    assert tokens == [t for o in whole for t in o.new_token_ids]
    assert cut[-1].finish_reason == "stop" and tokens[-1] == EOS
    jsonschema.validate(json.loads(bytes(tokens[:-1]).decode()), SCHEMA)
