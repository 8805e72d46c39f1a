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
from shardlib.structured_output import StructuredOutput, closed_objects
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


def test_an_all_of_of_several_parts_stays_open_and_one_part_alone_is_the_object():
    """llguidance intersects allOf's parts: closed one by one, {a} and {b} allowed only {}. The holder
    is not closed either (its keys come from the parts: closed with none of its own, it allowed only
    {}), nor given its parts' keys (naming them through chains of references grew the schema with
    the square of its size)."""
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                                          {"$ref": "#/$defs/B"}],
              "$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    closed = closed_objects(schema)
    assert all("additionalProperties" not in part for part in (closed, *closed["allOf"], closed["$defs"]["B"]))
    # one part alone (a $ref wrapped to carry a description, as pydantic 1 writes a described field)
    # composes nothing: the target is the whole object and is closed; the holder names no key
    wrapped = closed_objects({"type": "object", "allOf": [{"$ref": "#/$defs/A"}], "description": "d",
                              "$defs": {"A": {"type": "object", "properties": {"a": {}}}}})
    assert "additionalProperties" not in wrapped and wrapped["$defs"]["A"]["additionalProperties"] is False


def test_what_describes_one_object_with_another_stays_open_and_the_rest_closes():
    """The keep-open rule (closed_objects' _kept_open), read off the walk's result."""
    place = {"type": "object", "properties": {"name": {"type": "string"}}}
    # a pure union (Optional[Model]) closes its branch's target; a target also used as an allOf
    # part elsewhere stays open; a deeper pointer with ~1 in a name is followed
    schema = {"type": "object", "properties": {
        "maybe": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
        "both": {"$ref": "#/$defs/Shared"},
        "mixed": {"allOf": [{"$ref": "#/$defs/Shared"}, {"properties": {"n": {}}}]},
        "deep": {"allOf": [{"$ref": "#/$defs/Outer/properties/a~1b"}, {"properties": {"m": {}}}]},
        "typed_ref": {"type": "object", "$ref": "#/$defs/Typed"},
    }, "$defs": {"Place": place, "Shared": place, "Typed": place,
                 "Outer": {"type": "object", "properties": {"a/b": place}}}}
    closed = closed_objects(schema)
    at, defs = closed["properties"], closed["$defs"]
    assert defs["Place"]["additionalProperties"] is False
    assert "additionalProperties" not in defs["Shared"]  # an allOf part at "mixed", plain at "both"
    assert "additionalProperties" not in at["mixed"] and "properties" not in at["mixed"]  # nothing named at the holder
    assert "additionalProperties" not in defs["Outer"]["properties"]["a/b"]
    assert defs["Outer"]["additionalProperties"] is False  # the object holding it is no part
    # a $ref beside a type object is not closed itself (it allowed only {} then); its target is
    assert "additionalProperties" not in at["typed_ref"] and defs["Typed"]["additionalProperties"] is False
    # an object with properties of its own beside anyOf: it, the branches and their targets stay open
    union = closed_objects({"type": "object", "properties": {"kind": {}},
                            "anyOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {}}}],
                            "$defs": {"A": {"type": "object", "properties": {"a": {}}}}})
    assert all("additionalProperties" not in part for part in (union, *union["anyOf"], union["$defs"]["A"]))
    # so too beside an allOf (no properties of its own): a closed branch refused the part's keys
    beside_all_of = closed_objects({"allOf": [{"properties": {"a": {}}}], "anyOf": [{"properties": {"b": {}}}]})
    assert "additionalProperties" not in beside_all_of["anyOf"][0]
    # a $ref beside an allOf, and conditional parts (dependentSchemas, if/then): all describe the holder's object
    ref_and_part = closed_objects({"$ref": "#/$defs/A", "allOf": [{"properties": {"b": {}}}],
                                   "$defs": {"A": {"type": "object", "properties": {"a": {}}}}})
    assert "additionalProperties" not in ref_and_part["$defs"]["A"]
    dependent = closed_objects({"type": "object", "properties": {"a": {}, "b": {}},
                                "dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}}}},
                                "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"c": {}}}})
    assert all("additionalProperties" not in part
               for part in (dependent, dependent["dependentSchemas"]["a"], dependent["if"], dependent["then"]))


def test_a_pointer_with_a_digit_python_reads_but_int_does_not_is_not_followed():
    """"¹" is a digit to str.isdigit, not to int(): a 400 read "invalid literal for int()"."""
    closed = closed_objects({"allOf": [{"$ref": "#/allOf/¹"}, {"properties": {"a": {}}}]})
    assert "additionalProperties" not in closed


def test_an_all_of_under_strict_takes_its_parts_keys_and_types(grammar_tokenizer):  # noqa: F811
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                                          {"properties": {"b": {"type": "integer"}}}]}
    spec = StructuredOutput(json=closed_objects(schema))
    assert accepts(grammar_tokenizer, spec, '{"a": "x", "b": 1}')
    assert not accepts(grammar_tokenizer, spec, '{"a": "x", "b": "y"}')  # the part's type still holds
    assert not accepts(grammar_tokenizer, spec, '{"b": 1}')  # and its required key
    assert accepts(grammar_tokenizer, spec, '{"a": "x", "c": 1}')  # left open: README says so


PLAIN = {"type": "object", "properties": {"x": {"type": "integer"}}}
"""A plain nested object in each schema below: strict still closes it."""
A_DEF = {"A": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}
B = {"b": {"type": "integer"}}
# name: (schema, texts it accepts, texts strict refuses)
BESIDE_OTHERS = {
    "allOf: a $ref part and a part with its own required key": (
        {"type": "object", "allOf": [{"$ref": "#/$defs/A"}, {"properties": {**B, "p": PLAIN}, "required": ["b"]}],
         "$defs": A_DEF},
        ['{"a": "x", "b": 1}', '{"a": "x", "b": 1, "c": 2}'], ['{"a": "x", "b": 1, "p": {"x": 1, "y": 2}}']),
    "properties beside anyOf branches naming keys": (
        {"type": "object", "properties": {"kind": {"type": "string"}, "p": PLAIN},
         "anyOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                   {"properties": B, "required": ["b"]}]},
        ['{"kind": "k", "a": "x"}', '{"kind": "k", "b": 1}'], ['{"kind": "k", "a": "x", "p": {"x": 1, "y": 2}}']),
    "properties beside an allOf of a $ref": (
        {"type": "object", "properties": {"c": {"type": "integer"}, "p": PLAIN}, "allOf": [{"$ref": "#/$defs/A"}],
         "$defs": A_DEF},
        ['{"c": 1, "a": "x"}'], ['{"c": 1, "a": "x", "p": {"x": 1, "y": 2}}']),
    "a $ref beside properties": (
        {"type": "object", "$ref": "#/$defs/A", "properties": {**B, "p": PLAIN}, "$defs": A_DEF},
        ['{"a": "x", "b": 1}'], ['{"a": "x", "b": 1, "p": {"x": 1, "y": 2}}']),
    "anyOf branches beside an allOf": (
        {"allOf": [{"properties": {"a": {"type": "string"}, "p": PLAIN}, "required": ["a"]}],
         "anyOf": [{"properties": B, "required": ["b"]}]},
        ['{"a": "x", "b": 1}'], ['{"a": "x", "b": 1, "p": {"x": 1, "y": 2}}']),
    "a $ref beside an allOf": (
        {"$ref": "#/$defs/A", "allOf": [{"properties": {**B, "p": PLAIN}, "required": ["b"]}], "$defs": A_DEF},
        ['{"a": "x", "b": 1}'], ['{"a": "x", "b": 1, "p": {"x": 1, "y": 2}}']),
    "a described field (an allOf of one $ref) closes the model": (
        {"type": "object", "properties": {"m": {"allOf": [{"$ref": "#/$defs/A"}], "description": "d"}},
         "$defs": A_DEF},
        ['{"m": {"a": "x"}}'], ['{"m": {"a": "x", "z": 1}}']),
    "Optional Model: a pure union closes the model": (
        {"type": "object", "properties": {"m": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}},
         "$defs": A_DEF},
        ['{"m": {"a": "x"}}', '{"m": null}'], ['{"m": {"a": "x", "z": 1}}', '{"m": null, "z": 1}']),
}


@pytest.mark.parametrize("name", list(BESIDE_OTHERS))
def test_a_schema_that_describes_an_object_with_others_keeps_their_keys(grammar_tokenizer, name):  # noqa: F811
    """Closed alone, each schema refused the others' keys (a required one: "Unsatisfiable schema");
    llguidance's real matcher reads the closed schema. A plain object inside is still closed."""
    schema, accepted, refused = BESIDE_OTHERS[name]
    spec = StructuredOutput(json=closed_objects(schema))
    for text in accepted:
        assert accepts(grammar_tokenizer, StructuredOutput(json=schema), text), text  # the schema as sent takes it
        assert accepts(grammar_tokenizer, spec, text), text
    for text in refused:
        assert not accepts(grammar_tokenizer, spec, text), text


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


ADDR = {"type": "object", "properties": {"city": {"type": "string"}}}


def addressed(name: str, strict: bool, addr: dict = ADDR, to: dict | None = None) -> dict:
    parameters = {"type": "object", "properties": {"to": to or {"$ref": "#/$defs/Addr"}}, "required": ["to"],
                  "$defs": {"Addr": addr}}
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}


def required_refusal(*tools: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        chat(tools=list(tools), tool_choice="required").sampling()
    return caught.value


def test_required_tools_sharing_a_definition_strict_alike_share_it(grammar_tokenizer):  # noqa: F811
    """Definitions move to the "required" schema's root, one namespace: byte-identical ones, closed alike, merge."""
    for strict in (True, False):
        spec = chat(tools=[addressed("send", strict), addressed("ship", strict)], tool_choice="required").sampling()
        call = '[{"name": "ship", "parameters": {"to": {"city": "Paris", "zip": "1"}}}]'
        assert accepts(grammar_tokenizer, spec.structured_output, call) is not strict


def test_a_definition_sent_alike_but_closed_by_one_tools_strict_is_named_so():
    """The client sent two identical $defs.Addr: "differs from another tool's" named nothing it could see."""
    for strict, closing, open_one in (((True, False), 0, 1), ((False, True), 1, 0)):
        refusal = required_refusal(addressed("send", strict[0]), addressed("ship", strict[1]))
        assert refusal.param == "tools.1.function.parameters"
        assert refusal.message == (f"tools.1.function.parameters.$defs.Addr: strict: true closes it in tools.{closing} "
                                   f"but not in tools.{open_one}; give them different names, or make both tools "
                                   f"strict or neither")
    # both strict, one keeping Addr open as an allOf part: said so, not "strict closes it in one but not the other"
    part_of = {"allOf": [{"$ref": "#/$defs/Addr"}, {"properties": {"floor": {"type": "integer"}}}]}
    refusal = required_refusal(addressed("send", True), addressed("ship", True, to=part_of))
    assert refusal.message.startswith("tools.1.function.parameters.$defs.Addr: strict: true closes it in one of "
                                      "tools.0 and tools.1 and leaves it open in the other"), refusal.message
    # Addr sent alike in both, but kept open in one by a Y sent differently (an allOf part there):
    # Y is named, as the client can see it differs, not "strict closes it in one of them"
    tools = [addressed(name, True) for name in ("send", "ship")]
    tools[0]["function"]["parameters"]["$defs"]["Y"] = {"allOf": [{"$ref": "#/$defs/Addr"},
                                                                  {"properties": {"floor": {"type": "integer"}}}]}
    tools[1]["function"]["parameters"]["$defs"]["Y"] = {"type": "object", "properties": {"v": {}}}
    refusal = required_refusal(*tools)
    assert refusal.message.startswith("tools.1.function.parameters.$defs.Y differs from tools.0's $defs.Y"), \
        refusal.message
    # sent differently: the tool the other one came from is named
    refusal = required_refusal(addressed("send", True), addressed("ship", True, addr={**ADDR, "required": ["city"]}))
    assert refusal.message.startswith("tools.1.function.parameters.$defs.Addr differs from tools.0's $defs.Addr; "
                                      "the tools' definitions share one namespace here"), refusal.message


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
