"""Structured-output schemas llguidance would read otherwise than they say (integers past 2**53, its
private "x-guidance" options), refused where the request is made; and the server's parse, which
checks a request's grammar with llguidance, kept off the event loop for a body that asks for one."""

from __future__ import annotations

import json
import threading

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving.openai_protocol import ProtocolError
from shardlib.structured_output import StructuredOutput
from tests.test_tokenize_routes import MODEL, answer, refusal_of, scripted_server
from workers.structured import grammars
from workers.structured.grammars import grammar_problem

PAST_EXACT = 2 ** 53 + 1
"""The first integer a 64-bit float cannot hold: llguidance generated 2**53 for {"const": it}."""


# ---- integers past 2**53 -------------------------------------------------------------------------
@pytest.mark.parametrize("schema, keyword, path", [
    ({"const": PAST_EXACT}, "const", "#/const"),
    ({"enum": [12345678901234567890, "x"]}, "enum", "#/enum/0"),
    ({"enum": [{"id": [1, -PAST_EXACT]}]}, "enum", "#/enum/0/id/1"),
    ({"type": "integer", "minimum": -2 ** 60}, "minimum", "#/minimum"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer", "maximum": 2 ** 64}]}}}, "maximum",
     "#/properties/a/anyOf/0/maximum"),
    ({"type": "array", "items": {"type": "integer", "exclusiveMinimum": PAST_EXACT}}, "exclusiveMinimum",
     "#/items/exclusiveMinimum"),
    ({"type": "array", "prefixItems": [{"type": "integer", "exclusiveMaximum": PAST_EXACT}]}, "exclusiveMaximum",
     "#/prefixItems/0/exclusiveMaximum"),
    ({"$defs": {"n": {"type": "integer", "multipleOf": PAST_EXACT}}, "$ref": "#/$defs/n"}, "multipleOf",
     "#/$defs/n/multipleOf"),
    ({"type": "object", "additionalProperties": {"allOf": [{"const": PAST_EXACT}]}}, "const",
     "#/additionalProperties/allOf/0/const"),
    ({"type": "object", "patternProperties": {"^x": {"const": [PAST_EXACT]}}}, "const",
     "#/patternProperties/^x/const/0"),
])
def test_an_integer_past_2_53_is_refused_naming_its_keyword_and_place(schema, keyword, path):
    for given in (schema, json.dumps(schema)):  # a mapping (the driver API) or JSON text (the CLI)
        with pytest.raises(ValueError) as caught:
            StructuredOutput(json=given)
        message = str(caught.value)
        assert f"{keyword} at {path} " in message and "2**53" in message, message
        assert "use a string" in message and "a bound within 2**53" in message, message


def test_integers_up_to_2_53_floats_and_keyword_like_names_are_taken():
    for schema in ({"const": 2 ** 53}, {"enum": [-2 ** 53, 1.5e300, "x"]}, {"type": "number", "maximum": 2.5e15},
                   {"type": "integer", "minimum": -2 ** 53, "maximum": 2 ** 53},
                   # names of properties, and values of keywords that bound nothing, are not read as numbers
                   {"type": "object", "properties": {"const": {"type": "integer"}, "x-guidance": {"type": "string"}}},
                   {"type": "integer", "default": PAST_EXACT, "examples": [PAST_EXACT]}):
        spec = StructuredOutput(json=schema)
        assert grammar_problem(spec) is None, schema
    # kept exactly (not rounded) in the JSON text llguidance is given
    assert json.loads(StructuredOutput(json={"const": 2 ** 53}).json) == {"const": 9007199254740992}


def test_the_server_refuses_an_integer_past_2_53_naming_the_field():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ProtocolError) as caught:
        proto.parse_request(proto.ChatCompletionRequest, dict(chat, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"const": PAST_EXACT}}}))
    assert caught.value.param == "response_format.json_schema.schema", caught.value.param
    assert "const at #/const holds 9007199254740993" in caught.value.message, caught.value.message
    with pytest.raises(ProtocolError) as caught:
        proto.parse_request(proto.ChatCompletionRequest, dict(chat, structured_outputs={"json": {"enum": [2 ** 63]}}))
    assert caught.value.param == "structured_outputs.json" and "enum at #/enum/0" in caught.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": PAST_EXACT}}}}}
    with pytest.raises(ProtocolError) as caught:
        proto.parse_request(proto.ChatCompletionRequest, dict(chat, tools=[tool], tool_choice={
            "type": "function", "function": {"name": "f"}}))
    assert caught.value.param == "tools.0.function.parameters", caught.value.param
    assert "maximum at #/properties/n/maximum" in caught.value.message, caught.value.message


# ---- llguidance's private options ----------------------------------------------------------------
@pytest.mark.parametrize("options", [{"lenient": True}, {"whitespace_flexible": True}, {}])
def test_a_schema_carrying_x_guidance_is_refused(options):
    # lenient made an unknown format pass (the output then ignores it); whitespace_flexible undid
    # the server's no-free-whitespace rule
    schema = {"type": "string", "format": "no-such-format", "x-guidance": options}
    with pytest.raises(ValueError, match=r'"x-guidance" at #: .*not a JSON Schema keyword.*remove it'):
        StructuredOutput(json=schema)
    with pytest.raises(ValueError, match=r'"x-guidance" at #/properties/a/items: '):
        StructuredOutput(json={"type": "object", "properties": {"a": {"type": "array", "items": schema}}})


def test_the_server_refuses_x_guidance_naming_the_field():
    with pytest.raises(ProtocolError) as caught:
        proto.parse_request(proto.ChatCompletionRequest, {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "x-guidance": {"lenient": True}}}}})
    assert caught.value.param == "response_format.json_schema.schema", caught.value.param
    assert '"x-guidance"' in caught.value.message, caught.value.message


# ---- the parse of a body that asks for structure: off the event loop -----------------------------
def test_a_body_that_asks_for_structure_is_parsed_on_a_thread_whatever_its_size():
    from launcher.serving.openai_app import asks_for_structure

    schema = {"name": "s", "schema": {"type": "object"}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    asking = [{"response_format": {"type": "json_schema", "json_schema": schema}},
              {"response_format": {"type": "json_object"}},
              {"structured_outputs": {"regex": "[0-9]+"}},
              {"tools": [tool], "tool_choice": "required"},
              {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
              {"text": {"format": {"type": "json_schema", "name": "s", "schema": {}}}}]  # /v1/responses
    plain = [{}, {"response_format": {"type": "text"}}, {"tools": [tool]}, {"tools": [tool], "tool_choice": "auto"},
             {"tools": [tool], "tool_choice": "none"}, {"tool_choice": "required"}, [1, 2], "text", None]
    assert [asks_for_structure(body) for body in asking] == [True] * len(asking)
    assert [asks_for_structure(body) for body in plain] == [False] * len(plain)


def test_the_grammar_check_of_a_small_structured_request_runs_off_the_event_loop(smollm2_tokenizer, monkeypatch):
    server = scripted_server(smollm2_tokenizer, '{"a": 1}')
    checked_on = []

    def recorded(spec):  # the real check, where it ran recorded
        checked_on.append(threading.current_thread())
        return real(spec)

    real = grammars.grammar_problem
    monkeypatch.setattr(grammars, "grammar_problem", recorded)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = dict(chat, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert len(json.dumps(body)) < 1024  # small: parsed on the event loop before
    reply = answer(server, "/v1/chat/completions", body)
    assert json.loads(reply["choices"][0]["message"]["content"]) == {"a": 1}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    refused = refusal_of(server, "/v1/chat/completions", dict(chat, tools=[dict(tool, function=dict(
        tool["function"], parameters={"type": "object", "properties": {"a": {"type": "nope"}}}))],
        tool_choice="required"))
    assert refused.param == "tools.0.function.parameters", (refused.param, refused.message)
    assert len(checked_on) >= 2 and threading.main_thread() not in checked_on, checked_on


def test_a_structure_refused_on_the_thread_is_named_and_counted_once(smollm2_tokenizer):
    from tests.test_tokenize_routes import _requests_counted

    server = scripted_server(smollm2_tokenizer, "x")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"const": PAST_EXACT}}}}
    err = refusal_of(server, "/v1/chat/completions", body)
    assert err.status == 400 and err.param == "response_format.json_schema.schema", (err.status, err.param)
    exposition = server.metrics.render().decode()
    assert _requests_counted(exposition) == 1, [line for line in exposition.splitlines() if "requests_total" in line]
