"""A oneOf llguidance cannot enforce (branches that can overlap) is refused with a fix the sender
can make (anyOf, or exclusive branches), not llguidance's advice to enable its coerce_one_of option,
which a request cannot set (its "x-guidance" key is refused): on the compile check, so on every
OpenAI route, and on a matcher's own error alike."""

from __future__ import annotations

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
from shardlib.structured_output import StructuredOutput
from workers.structured.grammars import OVERLAPPING_ONE_OF, grammar_problem
from workers.structured.matchers import GrammarRefused, GrammarTokenizer, start_matcher

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
OVERLAPPING = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
PET = {"type": "object", "properties": {"pet": {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "cat"}}},
    {"type": "object", "properties": {"kind": {"const": "dog"}}}]}}}
"""Pydantic's discriminated union as a client may write it: the const is not required, so an
object without `kind` matches both branches."""


def refused(body: dict) -> str:
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {**BASE, **body})
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize("schema", [OVERLAPPING, PET], ids=["top-level", "nested"])
def test_the_compile_check_names_the_fix(schema):
    assert grammar_problem(StructuredOutput(json=schema)) == OVERLAPPING_ONE_OF


def test_response_format_and_a_forced_tool_call_give_the_same_fix():
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}}
    tools = [{"type": "function", "function": {"name": "adopt", "parameters": PET}}]
    for body in (rf, {"tools": tools, "tool_choice": "required"},
                 {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "adopt"}}}):
        message = refused(body)
        assert OVERLAPPING_ONE_OF in message and "coerce_one_of" not in message


def test_a_matchers_own_error_names_the_fix(smollm2_tokenizer):
    tokenizer = GrammarTokenizer(lambda: smollm2_tokenizer, len(smollm2_tokenizer))
    with pytest.raises(GrammarRefused) as caught:
        start_matcher(tokenizer, StructuredOutput(json=OVERLAPPING))
    assert caught.value.reason == OVERLAPPING_ONE_OF


def test_both_fixes_named_are_taken():
    exclusive = {"type": "object", "properties": {"pet": {"oneOf": [
        {**branch, "required": ["kind"]} for branch in PET["properties"]["pet"]["oneOf"]]}}}
    any_of = {"type": "object", "properties": {"pet": {"anyOf": PET["properties"]["pet"]["oneOf"]}}}
    for schema in (exclusive, any_of):
        assert grammar_problem(StructuredOutput(json=schema)) is None
