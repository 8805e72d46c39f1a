"""`strict: true` on a tool (tools[].function.strict) or a response_format's json_schema closes the
schema's objects: a key the schema does not name is not generated, as OpenAI's strict mode answers
(taken and ignored before, an open {"city"} schema let a model add "location", and a client passing
the arguments straight to its function failed). An object that says additionalProperties itself
keeps what it says. The walk itself (shardlib.structured_output.closed_objects), then the grammar a
request builds, read by llguidance's real matcher over SmolLM2's tokenizer, then generation on a
random model with SmolLM2's vocabulary in the serving loop."""

from __future__ import annotations

import copy
import json

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
from shardlib.structured_output import closed_objects
from tests.test_structured_output import fresh_loop, run, structured, wide_model  # noqa: F401 (a fixture)
from tests.test_unenforced_schema_formats import accepts, grammar_tokenizer  # noqa: F401 (a fixture)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
EXACT, EXTRA = '{"city": "Paris"}', '{"city": "Paris", "location": "Europe"}'


# ---- the walk ------------------------------------------------------------------------------------
def test_every_object_in_every_schema_position_is_closed():
    schema = {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "number"}}},
            "tags": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},  # no type: an object
            "pair": {"type": "array", "prefixItems": [{"type": "object"}, {"type": "string"}]},
            "either": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
            "one": {"oneOf": [{"type": ["object", "null"], "properties": {"a": {}}}]},
            "by_pattern": {"type": "object", "patternProperties": {"^x": {"type": "object"}},
                           "additionalProperties": {"type": "object"}},
        },
        "$defs": {"Place": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "definitions": {"Old": {"type": "object"}},
    }
    sent = copy.deepcopy(schema)
    closed = closed_objects(schema)
    assert schema == sent  # the caller's schema is not changed
    at = closed["properties"]
    for part in (closed, at["point"], at["tags"]["items"], at["pair"]["prefixItems"][0], at["one"]["oneOf"][0],
                 at["by_pattern"]["patternProperties"]["^x"], at["by_pattern"]["additionalProperties"],
                 closed["$defs"]["Place"], closed["definitions"]["Old"]):
        assert part["additionalProperties"] is False, part
    # what is no object schema stays as it was: a string, a $ref (its target is closed), a union holder
    for part in (at["pair"]["prefixItems"][1], at["either"], at["either"]["anyOf"][0], at["either"]["anyOf"][1]):
        assert "additionalProperties" not in part, part
    # the object with patternProperties said additionalProperties (a schema) itself: kept
    assert at["by_pattern"]["additionalProperties"] == {"type": "object", "additionalProperties": False}


def test_an_object_that_says_what_other_keys_do_is_honoured_and_not_is_left_alone():
    schema = {"type": "object", "properties": {
        "free": {"type": "object", "additionalProperties": True},
        "counted": {"type": "object", "additionalProperties": {"type": "integer"}},
        "evaluated": {"type": "object", "unevaluatedProperties": False},
        "never": {"not": {"type": "object", "properties": {"a": {}}}},  # negated: closing it would widen it
    }}
    at = closed_objects(schema)["properties"]
    assert at["free"]["additionalProperties"] is True
    assert at["counted"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in at["evaluated"]
    assert "additionalProperties" not in at["never"]["not"]


def test_an_all_of_is_closed_at_its_holder_naming_its_parts_keys():
    """llguidance intersects allOf's parts: closed one by one, {a} and {b} allowed only {}."""
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                                          {"properties": {"b": {"type": "integer"}}}]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"] == {"a": {}, "b": {}}
    assert all("additionalProperties" not in part for part in closed["allOf"])
    # a part whose keys are not listed (a $ref) cannot be named: the holder stays as open as it was
    by_reference = closed_objects({"type": "object", "allOf": [{"$ref": "#/$defs/A"}],
                                   "$defs": {"A": {"type": "object", "properties": {"a": {}}}}})
    assert "additionalProperties" not in by_reference
    assert by_reference["$defs"]["A"]["additionalProperties"] is False


def test_a_closed_all_of_takes_its_parts_keys_and_no_other(grammar_tokenizer):  # noqa: F811
    from shardlib.structured_output import StructuredOutput

    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                                          {"properties": {"b": {"type": "integer"}}}]}
    spec = StructuredOutput(json=closed_objects(schema))
    assert accepts(grammar_tokenizer, spec, '{"a": "x", "b": 1}')
    assert not accepts(grammar_tokenizer, spec, '{"a": "x", "b": "y"}')  # the part's type still holds
    assert not accepts(grammar_tokenizer, spec, '{"a": "x", "c": 1}')
    assert not accepts(grammar_tokenizer, spec, '{"b": 1}')  # and its required key


# ---- the request's grammar ------------------------------------------------------------------------
def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Weather?"}],
                                                 **fields})


def weather_tool(strict: bool | None, schema: dict = CITY) -> dict:
    function = {"name": "get_weather", "parameters": schema}
    return {"type": "function", "function": function if strict is None else {**function, "strict": strict}}


def structure(strict: bool | None, how: str, schema: dict = CITY):
    if how == "response_format":
        json_schema = {"name": "weather", "schema": schema, **({} if strict is None else {"strict": strict})}
        request = chat(response_format={"type": "json_schema", "json_schema": json_schema})
    else:
        request = chat(tools=[weather_tool(strict, schema)],
                       tool_choice="required" if how == "required" else {"type": "function",
                                                                          "function": {"name": "get_weather"}})
    return request.sampling().structured_output


def as_sent(how: str, arguments: str) -> str:
    """The output text that gives these arguments: a "required" call is a list of named calls."""
    return f'[{{"name": "get_weather", "parameters": {arguments}}}]' if how == "required" else arguments


@pytest.mark.parametrize("how", ["named", "required", "response_format"])
def test_strict_refuses_a_key_the_schema_does_not_name(grammar_tokenizer, how):  # noqa: F811
    strict = structure(True, how)
    assert accepts(grammar_tokenizer, strict, as_sent(how, EXACT))
    assert not accepts(grammar_tokenizer, strict, as_sent(how, EXTRA))
    for loose in (structure(False, how), structure(None, how)):  # not strict: the schema as sent, open
        assert accepts(grammar_tokenizer, loose, as_sent(how, EXTRA))


def test_the_schema_a_client_sent_is_not_changed_and_the_template_shows_it_as_sent():
    tool = weather_tool(True)
    request = chat(tools=[tool], tool_choice="required")
    assert CITY == {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert request.template_tools()[0]["function"]["parameters"] == CITY


def test_strict_is_still_a_boolean():
    with pytest.raises(ProtocolError) as caught:
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": CITY, "strict": "yes"}}])
    assert caught.value.param == "tools.0.function.strict" and "true or false" in caught.value.message


# ---- generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["named", "response_format"])
def test_generated_arguments_hold_only_the_named_keys(wide_model, smollm2_tokenizer, how):  # noqa: F811
    """Sampled from a random model, an open {"city"} object gains made-up keys; strict, it cannot."""
    tok = smollm2_tokenizer
    # the city one of a few: a random model's free string runs to max_tokens
    spec = structure(True, how, {**CITY, "properties": {"city": {"enum": ["Paris", "Rome"]}}})
    requests = [structured(f"strict-{seed}", tok.encode("Weather in Paris:"), spec, max_tokens=60, temperature=1.0,
                           seed=seed) for seed in range(4)]
    out = run(fresh_loop(wide_model, tok), requests)
    for r in requests:
        text = tok.decode(out.tokens[r.request_id])
        assert out.finish[r.request_id] == "stop", (r.request_id, text)
        assert list(json.loads(text)) == ["city"], (r.request_id, text)
