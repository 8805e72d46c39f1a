"""JSON read from a model's tool calls (launcher/serving/call_json.py), in every reader: nesting past
MAX_DEPTH is no call's JSON, the same for the whole and the streamed reading whatever the caller's
stack depth (RecursionError came near ~1000 levels, at a depth that moved with the stack, and an
encoder's escaped as a 500); a lone surrogate escape in the arguments is written back escaped, so the
whole answer can be sent as UTF-8 (it failed with UnicodeEncodeError), and a name holding one is
no call."""

from __future__ import annotations

import json

import pytest

from launcher.serving.call_json import MAX_DEPTH, arguments_text, is_text, too_deep
from launcher.serving.hermes_calls import HermesCallReader
from launcher.serving.llama_calls import Llama3JsonCallReader
from launcher.serving.mistral_calls import MistralCallReader
from launcher.serving.required_calls_stream import RequiredCallsStream
from launcher.serving.tool_calls import ToolCallReader
from tests.call_reader_checks import reassembled, same_json

READERS = {  # each format's call around `arguments` (JSON text), the name given
    "hermes": (HermesCallReader, lambda name, arguments: f'<tool_call>{{"name": {name}, "arguments": {arguments}}}'
                                                         f'</tool_call>'),
    "llama3_json": (Llama3JsonCallReader, lambda name, arguments: f'{{"name": {name}, "parameters": {arguments}}}'),
    "mistral": (MistralCallReader, lambda name, arguments: f'[TOOL_CALLS][{{"name": {name}, "arguments": {arguments}}}]'),
}
CALL_LEVELS = {"hermes": 1, "llama3_json": 1, "mistral": 2}
"""The nesting each format's call puts around its arguments (an object; mistral's array of them)."""


def test_too_deep_counts_nesting_outside_strings_up_to_where_the_value_closes():
    assert not too_deep("[" * MAX_DEPTH + "]" * MAX_DEPTH) and too_deep("[" * (MAX_DEPTH + 1))
    assert not too_deep('{"a": "' + "[" * 2000 + '"}')  # brackets inside a string
    assert not too_deep('["\\"' + "{" * 2000 + '"]')  # an escaped quote does not end the string
    assert not too_deep("[1] " + "[" * 2000, 0)  # the first value closed: what follows is not read
    assert not too_deep("12 " + "[" * 2000) and not too_deep('"s" ' + "[" * 2000)  # scalars
    assert too_deep("x = " + "{" * 600, 4) and too_deep("   " + "{" * 600)


def test_arguments_with_a_lone_surrogate_are_written_with_ascii_escapes():
    assert arguments_text({"s": "été"}) == '{"s": "été"}'  # non-ASCII kept, as vLLM writes it
    escaped = arguments_text({"s": "\ud83d"})
    assert escaped == '{"s": "\\ud83d"}' and is_text(escaped) and json.loads(escaped) == {"s": "\ud83d"}
    assert is_text("ok") and not is_text("\udc00") and not is_text(5)


def read_both(reader_class, text: str, depth_below: int = 0) -> tuple[dict, dict]:
    """(the whole answer's message, the stream's content and calls), read `depth_below` frames deeper."""
    if depth_below:
        return read_both(reader_class, text, depth_below - 1)
    whole = reader_class()
    whole.push(text, True)
    streamed = reader_class()
    deltas = [streamed.delta(text[i:i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    calls = [call["function"] for call in reassembled([call for d in deltas for call in d.get("tool_calls", [])])]
    message = whole.message()
    for call in message.get("tool_calls", []):
        call.pop("id")  # new at each reading
    return message, {"content": "".join(d.get("content", "") for d in deltas), "calls": calls}


@pytest.mark.parametrize("parser", READERS)
@pytest.mark.parametrize("depth", [MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 5, 901, 988, 3000])
def test_deep_arguments_read_the_same_whole_and_streamed_at_any_stack_depth(parser, depth):
    reader_class, form = READERS[parser]
    text = form('"f"', "[" * depth + "]" * depth)
    answers = [read_both(reader_class, text, below) for below in (0, 150)]
    assert answers[0] == answers[1]  # the caller's stack changes nothing
    message, stream = answers[0]
    json.dumps(message, ensure_ascii=False).encode("utf-8")  # the whole answer can be sent
    if depth + CALL_LEVELS[parser] <= MAX_DEPTH:  # the arguments' nesting plus the call's own levels
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
        [streamed_call] = stream["calls"]  # streamed whole, to the arguments' end
        assert same_json(streamed_call["arguments"], message["tool_calls"][0]["function"]["arguments"])
    else:  # no call; the stream announced it before the nesting passed the limit (the readers' one
        # exception: the call went out, its arguments stop at the limit, the text follows as content)
        assert "tool_calls" not in message and message["content"] == text and stream["content"] == text
        [announced] = stream["calls"]
        assert announced["name"] == "f" and announced["arguments"].count("[") <= MAX_DEPTH


@pytest.mark.parametrize("parser", READERS)
def test_a_lone_surrogate_escape_is_sent_escaped_and_a_name_holding_one_is_no_call(parser):
    reader_class, form = READERS[parser]
    text = form('"f"', '{"s": "\\ud83d", "t": "été"}')
    message, stream = read_both(reader_class, text)
    [call] = message["tool_calls"]
    body = json.dumps(message, ensure_ascii=False).encode("utf-8")  # raised UnicodeEncodeError
    assert json.loads(call["function"]["arguments"]) == {"s": "\ud83d", "t": "été"} and b"\\ud83d" in body
    [streamed_call] = stream["calls"]  # the arguments as written: the same JSON
    assert streamed_call["name"] == "f" and same_json(streamed_call["arguments"], call["function"]["arguments"])
    named = form('"f\\udc00"', "{}")
    message, stream = read_both(reader_class, named)
    json.dumps(message, ensure_ascii=False).encode("utf-8")
    if parser == "mistral":  # a name that is no text is "" there, as vLLM makes a non-string name
        assert [c["function"]["name"] for c in message["tool_calls"]] == [""] and stream["calls"][0]["name"] == ""
    else:
        assert "tool_calls" not in message and stream["calls"] == []


def test_required_calls_take_the_same_rules():
    reader = ToolCallReader("required")
    reader.push('[{"name": "f", "parameters": {"s": "\\ud83d"}}]', True)
    [call] = reader.message()["tool_calls"]
    assert call["function"]["arguments"] == '{"s": "\\ud83d"}'
    deep = ToolCallReader("required")
    deep.push('[{"name": "f", "parameters": ' + "[" * 3000 + "]" * 3000 + "}]", True)
    assert "tool_calls" not in deep.message()
    stream = RequiredCallsStream()
    assert stream.feed('[{"name": "f\\udc00", "parameters": {}}]') == []  # as the whole reading: no call


def test_a_streamed_required_answer_stops_reading_at_the_depth_limit():
    """Past MAX_DEPTH the stream reads nothing more (it read on, sending arguments no reading takes):
    a call announced before the limit keeps what it sent, the documented exception (the whole
    reading has no call), and no later call goes out."""
    text = ('[{"name": "f", "parameters": ' + "[" * 200 + "]" * 200 + '}, {"name": "g", "parameters": {}}]')
    reader = ToolCallReader("required")
    deltas = [reader.delta(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    [call] = reader.calls()
    assert call["function"]["name"] == "f" and call["function"]["arguments"].count("[") <= MAX_DEPTH
    assert "]" not in call["function"]["arguments"] and sum(len(d.get("tool_calls", [])) for d in deltas) >= 1
    whole = ToolCallReader("required")
    whole.push(text, True)
    assert "tool_calls" not in whole.message()
