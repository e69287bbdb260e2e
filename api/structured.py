"""Structured outputs: the request fields that hold the output to a grammar, read into one
`StructuredOutput` for the engine.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), on both routes as vLLM has
it, and vLLM's `structured_outputs` object and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` fields; one of them at most per request. Only their shape
is checked here: what a schema, regex or grammar says is xgrammar's to judge, and xgrammar
loads torch, which an API replica does not (docs/design.md §14). The worker compiles it before
the request's first token, and one that does not compile ends the request before its response
starts, answered 400 naming the field (api/generation.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.messages import InvalidRequestError, StructuredOutput

MAX_CHOICES = 256  # `guided_choice` / `structured_outputs.choice` alternatives
MAX_SPEC_CHARS = 2**20  # a schema, regex or grammar as text: a bound on the worker's compile work

Spec = Annotated[str, Field(min_length=1, max_length=MAX_SPEC_CHARS)]
Choices = Annotated[list[Spec], Field(min_length=1, max_length=MAX_CHOICES)]
Schema = dict[str, Any]  # a JSON schema; xgrammar judges its content


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]  # OpenAI's rule
    description: Annotated[str, Field(max_length=MAX_SPEC_CHARS)] | None = None
    schema_: Schema = Field(alias="schema")
    # Accepted either way: the schema is always kept to, which is what `strict: true` asks for.
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: Schema | Spec | None = Field(default=None, alias="json")  # a schema, or one as JSON text
    regex: Spec | None = None
    choice: Choices | None = None
    grammar: Spec | None = None  # xgrammar's EBNF
    json_object: bool | None = None  # false: not asked for


class StructuredFields(_Strict):
    """The fields of a generation request that ask for a structured output (a base of both
    routes' requests)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Schema | Spec | None = None
    guided_regex: Spec | None = None
    guided_choice: Choices | None = None
    guided_grammar: Spec | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one grammar the request asks for, or None; InvalidRequestError for more than one."""
        asked = [
            (name, value)
            for name, value in (
                ("response_format", self._response_format()),
                ("structured_outputs", self._structured_outputs()),
                ("guided_json", _json_schema("guided_json", self.guided_json)),
                ("guided_regex", _regex("guided_regex", self.guided_regex)),
                ("guided_choice", _choice("guided_choice", self.guided_choice)),
                ("guided_grammar", _grammar("guided_grammar", self.guided_grammar)),
            )
            if value is not None
        ]
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise InvalidRequestError(f"only one structured output may be asked for; got {names}", param=asked[1][0])
        return asked[0][1] if asked else None

    def _response_format(self) -> StructuredOutput | None:
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            return StructuredOutput("json_object", param="response_format")
        if isinstance(fmt, JsonSchemaFormat):
            return _json_schema("response_format", fmt.json_schema.schema_)
        return None  # absent, or `text`: no constraint

    def _structured_outputs(self) -> StructuredOutput | None:
        params, name = self.structured_outputs, "structured_outputs"
        if params is None:
            return None
        given = [
            v
            for v in (
                _json_schema(name, params.json_),
                _regex(name, params.regex),
                _choice(name, params.choice),
                _grammar(name, params.grammar),
                StructuredOutput("json_object", param=name) if params.json_object else None,
            )
            if v is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{name} must have exactly one of json, regex, choice, grammar, json_object; got {len(given)}",
                param=name,
            )
        return given[0]


def _json_schema(param: str, schema: Schema | str | None) -> StructuredOutput | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param}: the schema is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(f"{param}: a JSON schema is an object", param=param)
    return StructuredOutput("json_schema", json.dumps(schema), param)


def _regex(param: str, regex: str | None) -> StructuredOutput | None:
    return None if regex is None else StructuredOutput("regex", regex, param)


def _grammar(param: str, grammar: str | None) -> StructuredOutput | None:
    return None if grammar is None else StructuredOutput("grammar", grammar, param)


def _choice(param: str, choices: list[str] | None) -> StructuredOutput | None:
    """One of the strings, exactly: a grammar of their literals (JSON's string escapes are
    EBNF's; non-ASCII text is written as itself, which xgrammar reads as UTF-8)."""
    if choices is None:
        return None
    return StructuredOutput(
        "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices), param
    )
