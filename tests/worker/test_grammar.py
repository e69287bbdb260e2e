"""Structured outputs on the worker: grammars compiled with the shipped byte-level tokenizer,
the batch mask in front of the sampler, and a matcher rebuilt by replaying a request's outputs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from engine.messages import INVALID_GRAMMAR, NewRequestData, SamplingParams, StructuredOutput
from worker import grammar
from worker.grammar import GrammarCompiler
from worker.grammar_mask import RequestGrammar
from worker.sampler import Sampler
from worker.structured import InvalidGrammarError, StructuredOutputs

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-hybrid"
EOS, PAD = 256, 257  # the shipped tokenizer: 256 bytes, EOS, pad
WIDTH = 320  # logits wider than the tokenizer's 258: padded rows, as some checkpoints have
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
}
TOKENIZER = Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def structured():
    s = StructuredOutputs(str(MODEL), WIDTH, EOS)
    yield s
    s.close()


def _new(structured: StructuredOutput, prompt: list[int], num_prior_outputs: int = 0) -> NewRequestData:
    params = SamplingParams(structured=structured, num_prior_outputs=num_prior_outputs)
    return NewRequestData("r", prompt, params, [[]], 0)


def _generate(
    structured: StructuredOutputs, grammars: list[RequestGrammar | None], params: list[SamplingParams], steps: int
) -> list[list[int]]:
    """Sample `steps` tokens per row from random logits (one bad logit made huge per row at a
    padding id and at the pad token), masked by each row's grammar, advancing it."""
    sampler = Sampler(0, "cpu", WIDTH)
    gens = [sampler.generator_for(p) for p in params]
    noise = torch.Generator().manual_seed(7)
    outputs: list[list[int]] = [[] for _ in grammars]
    for _ in range(steps):
        logits = torch.randn(len(grammars), WIDTH, generator=noise) * 4
        logits[:, WIDTH - 1] = 50.0
        logits[:, PAD] = 40.0
        structured.mask(logits, grammars)
        tokens = sampler.sample(logits, params, gens).token_ids
        for row, (g, t) in enumerate(zip(grammars, tokens)):
            if g is not None and g.terminated:
                continue
            assert g is None or g.accept(t)
            outputs[row].append(t)
    return outputs


def _text(ids: list[int]) -> str:
    return TOKENIZER.decode([t for t in ids if t != EOS])


def test_a_schema_holds_every_row_and_leaves_the_others_alone(structured):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    rows = 6
    grammars: list[RequestGrammar | None] = [
        structured.matcher(_new(spec, [1, 2]), 2) if r % 2 == 0 else None for r in range(rows)
    ]
    params = [SamplingParams(temperature=0.0 if r == 0 else 1.0, seed=r) for r in range(rows)]
    outputs = _generate(structured, grammars, params, steps=120)
    for r, ids in enumerate(outputs):
        if grammars[r] is None:
            assert ids == [WIDTH - 1] * 120  # unmasked: the huge padding logit wins every time
            continue
        g = grammars[r]
        assert g is not None and g.terminated, f"row {r} did not finish: {_text(ids)!r}"
        assert ids[-1] == EOS and max(ids[:-1]) < EOS
        jsonschema.validate(json.loads(_text(ids)), SCHEMA)


def test_json_object_regex_and_grammar_kinds(structured):
    specs = [
        (StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict)),
        (StructuredOutput("regex", r"[a-c]{2,4}-[0-9]{3}"), lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text)),
        (
            StructuredOutput("grammar", 'root ::= "yes" | "no" | "naïve 😀"'),
            lambda text: text in {"yes", "no", "naïve 😀"},
        ),
    ]
    for spec, check in specs:
        # Random logits may keep a JSON string open past any budget: every token was accepted
        # (a valid prefix, checked in `_generate`), and every output that ended is checked.
        grammars: list[RequestGrammar | None] = [structured.matcher(_new(spec, [5]), 1) for _ in range(8)]
        params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(8)]
        ended = 0
        for g, ids in zip(grammars, _generate(structured, grammars, params, steps=300)):
            if g is not None and g.terminated:
                ended += 1
                assert check(_text(ids)), (spec, _text(ids))
        assert ended >= 2, spec


def test_eos_only_once_the_grammar_is_complete(structured):
    g = structured.matcher(_new(StructuredOutput("regex", "ab"), [5]), 1)
    assert g is not None
    for token, allowed in ((ord("a"), [ord("a")]), (ord("b"), [ord("b")]), (EOS, [EOS])):
        logits = torch.zeros(1, WIDTH)
        structured.mask(logits, [g])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed
        assert g.accept(token)
    assert g.terminated
    assert g.accept(7)  # a token sampled after EOS, by a step scheduled before it was known: dropped upstream


def test_the_matcher_is_the_grammar_advanced_by_the_outputs_so_far(structured):
    """A resumed request's earlier outputs end its prompt: the rebuilt matcher masks the next
    token exactly as the matcher that took them one by one."""
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prefix = list(b'{"name": "ab')
    prompt = [9, 9, 9]
    stepped = structured.matcher(_new(spec, prompt), len(prompt))
    assert stepped is not None
    for t in prefix:
        assert stepped.accept(t)
    replayed = structured.matcher(_new(spec, prompt + prefix, len(prefix)), len(prompt))
    a, b = torch.zeros(1, WIDTH), torch.zeros(1, WIDTH)
    structured.mask(a, [stepped])
    structured.mask(b, [replayed])
    assert torch.equal(a, b) and torch.isfinite(a).sum() < WIDTH
    with pytest.raises(ValueError, match="does not follow"):
        structured.matcher(_new(spec, [*prompt, *b"[1]"], 3), len(prompt))


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (StructuredOutput("json_schema", '{"type": "foo"}', "guided_json"), 'Unsupported type "foo"'),
        (StructuredOutput("json_schema", '{"type": "object", "properties": 5}'), "properties must be an object"),
        (StructuredOutput("regex", "((", "guided_regex"), ""),
        (StructuredOutput("grammar", "root ::= ", "structured_outputs"), ""),
    ],
)
def test_a_grammar_that_does_not_compile_is_the_requests_error(spec, reason):
    compiler = GrammarCompiler(str(MODEL), WIDTH, EOS)
    try:
        with pytest.raises(InvalidGrammarError) as e:
            compiler.get(spec)
        text = str(e.value)
        assert text.startswith(f"{INVALID_GRAMMAR}{spec.param}: ") and reason in text
        assert ".cc:" not in text  # xgrammar's source location is left out
        assert compiler.prefetch(spec)[0] is compiler.prefetch(spec)[0]  # compiled (and failed) once
        with pytest.raises(InvalidGrammarError, match=f"^{INVALID_GRAMMAR}other_field: "):
            compiler.get(dataclasses.replace(spec, param="other_field"))  # each request's error names its field
    finally:
        compiler.close()


def test_a_model_without_eos_has_no_structured_outputs():
    compiler = GrammarCompiler(str(MODEL), WIDTH, None)
    try:
        with pytest.raises(InvalidGrammarError, match="no EOS token"):
            compiler.get(StructuredOutput("json_object"))
    finally:
        compiler.close()


def test_a_grammar_past_its_compile_deadline_fails_its_request_and_goes_on_compiling(monkeypatch):
    """With no time to compile (the deadline at the moment compiling starts), the request
    fails as one whose grammar does not compile; the compile goes on, and the same grammar
    asked for again is found compiled."""
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.0)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    spec = StructuredOutput("json_schema", json.dumps(schema), "guided_json")
    compiler = GrammarCompiler(str(MODEL), WIDTH, EOS)
    try:
        with pytest.raises(InvalidGrammarError, match=f"^{INVALID_GRAMMAR}guided_json: did not compile within 0 s"):
            compiler.get(spec)
        future, _ = compiler.prefetch(spec)
        compiled = future.result()
        assert compiler.get(spec) is compiled
    finally:
        compiler.close()
