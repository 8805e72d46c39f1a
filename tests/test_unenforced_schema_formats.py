"""A JSON schema's `format` that llguidance does not enforce (pydantic's password for SecretStr,
path, binary; OpenAPI's byte) is an annotation, as JSON Schema reads it by default: left out of the
schema llguidance reads instead of refusing the request ("Unknown format: password"), on every
route that makes a schema a StructuredOutput (response_format, structured_outputs, a forced tool
call). Formats llguidance does enforce stay enforced, and only schema positions are touched: a
property named "format" and the values of const, enum, default and examples are kept as sent."""

from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import pytest
from llguidance import LLMatcher
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, SecretStr

from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
from shardlib.structured_output import ENFORCED_FORMATS, StructuredOutput
from workers.structured.grammars import JSON_OPTIONS, grammar_problem
from workers.structured.matchers import GrammarTokenizer, start_matcher

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Login(BaseModel):
    user: str
    password: SecretStr  # format "password"
    home: pathlib.Path  # format "path"
    blob: bytes  # format "binary"


LOGIN = '{"user": "ann", "password": "hunter2", "home": "/home/ann", "blob": "AAEC"}'


@pytest.fixture(scope="module")
def grammar_tokenizer(smollm2_tokenizer):
    return GrammarTokenizer(lambda: smollm2_tokenizer, len(smollm2_tokenizer))


def accepts(grammar_tokenizer, spec: StructuredOutput, text: str) -> bool:
    """Whether spec's matcher takes text's tokens and may end after them."""
    grammar = start_matcher(grammar_tokenizer, spec)
    try:
        for token in grammar_tokenizer.get().tokenize_str(text):
            grammar.advance(token)
    except ValueError:
        return False
    return grammar.accepting()


def llguidance_problem(schema: dict) -> str:
    """llguidance's own reason for a schema as sent, not made a StructuredOutput ('' when none)."""
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {**BASE, **fields})


def test_the_enforced_list_is_what_llguidance_enforces():
    # each listed format compiles as sent: one llguidance dropped would be refused here, not left out
    for name in sorted(ENFORCED_FORMATS):
        assert llguidance_problem({"type": "string", "format": name}) == "", name
    # and a format outside it is still refused by llguidance itself: leaving it out is what lets it through
    assert "Unknown format: password" in llguidance_problem({"type": "string", "format": "password"})


def test_a_pydantic_secret_path_and_bytes_model_is_taken_and_matched(grammar_tokenizer):
    schema = to_strict_json_schema(Login)
    assert schema["properties"]["password"]["format"] == "password"
    spec = StructuredOutput(json=schema)
    assert grammar_problem(spec) is None
    assert "format" not in json.dumps(json.loads(spec.json))  # password, path, binary: all annotations
    assert accepts(grammar_tokenizer, spec, LOGIN)
    jsonschema.validate(json.loads(LOGIN), schema)  # what was matched is valid by the schema as sent
    assert not accepts(grammar_tokenizer, spec, '{"user": "ann"}')  # the rest of the schema still holds


def test_response_format_and_structured_outputs_take_an_annotation_format():
    schema = to_strict_json_schema(Login)
    sent = copy.deepcopy(schema)
    request = chat(response_format={"type": "json_schema", "json_schema": {"name": "login", "schema": schema}})
    assert json.loads(request.sampling().structured_output.json)["properties"]["password"] == {
        "title": "Password", "type": "string", "writeOnly": True}
    assert schema == sent  # the caller's schema is not changed
    bare = chat(structured_outputs={"json": {"type": "string", "format": "byte"}})
    assert json.loads(bare.sampling().structured_output.json) == {"type": "string"}


def test_a_forced_tool_call_takes_an_openapi_byte_format():
    upload = {"type": "object", "properties": {"data": {"type": "string", "format": "byte"}}, "required": ["data"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "upload", "parameters": upload}}]
    required = chat(tools=tools, tool_choice="required").sampling().structured_output
    assert grammar_problem(required) is None and '"byte"' not in required.json
    named = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "upload"}})
    assert json.loads(named.sampling().structured_output.json)["properties"]["data"] == {"type": "string"}


def test_a_property_named_format_is_a_name_and_its_own_format_an_annotation(grammar_tokenizer):
    schema = {"type": "object", "properties": {"format": {"type": "string", "format": "password"}},
              "required": ["format"], "additionalProperties": False}
    spec = StructuredOutput(json=schema)
    assert json.loads(spec.json)["properties"] == {"format": {"type": "string"}}
    assert accepts(grammar_tokenizer, spec, '{"format": "hunter2"}')
    assert not accepts(grammar_tokenizer, spec, '{"other": "hunter2"}')


def test_values_are_kept_as_sent_and_every_schema_position_is_reached():
    values = {"const": {"format": "password"}, "enum": [{"format": "path"}], "default": {"format": "byte"},
              "examples": [{"format": "binary"}]}
    assert json.loads(StructuredOutput(json={"type": "object", **values}).json) == {"type": "object", **values}
    weak = {"type": "string", "format": "password"}
    nested = {"$defs": {"a": weak}, "definitions": {"b": weak}, "anyOf": [weak], "allOf": [weak],
              "items": weak, "prefixItems": [weak], "additionalProperties": weak, "patternProperties": {"^x": weak},
              "properties": {"p": {"type": "array", "items": [weak]}}, "not": weak, "if": weak, "then": weak,
              "else": weak, "contains": weak, "propertyNames": weak, "dependentSchemas": {"d": weak},
              "unevaluatedProperties": weak, "unevaluatedItems": weak, "format": "json-string"}
    assert "format" not in StructuredOutput(json=nested).json


def test_an_enforced_format_is_still_enforced(grammar_tokenizer):
    spec = StructuredOutput(json={"type": "string", "format": "email"})
    assert json.loads(spec.json) == {"type": "string", "format": "email"}
    assert accepts(grammar_tokenizer, spec, '"ann@example.com"')
    assert not accepts(grammar_tokenizer, spec, '"not an email"')
    mixed = StructuredOutput(json={"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                                                    "key": {"type": "string", "format": "password"}}})
    assert json.loads(mixed.json)["properties"] == {"when": {"type": "string", "format": "date"},
                                                    "key": {"type": "string"}}
