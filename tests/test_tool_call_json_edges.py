"""Tool calls at the edges of JSON, in every reader and in the conversation's history: NaN, Infinity
and numbers beyond a double's range are no call's JSON (json.dumps wrote them back as NaN and
Infinity, which JavaScript's JSON.parse refuses), whole and streamed; a "required" answer keeps a call
whose integer is past Python's digit limit, as its stream sends it (the whole answer lost it); such
arguments in the history, and this server's own arguments holding a lone surrogate escape, are read,
not a 500 or a 400; a tool_choice of another type is refused by its type; a pythonic dict key that is
no string, and a set, are no call."""

from __future__ import annotations

import json
import random

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving.call_json import arguments_text, decode_at, loads_or_none, shape_or_none
from launcher.serving.hermes_calls import HermesCallReader
from launcher.serving.llama_calls import Llama3JsonCallReader
from launcher.serving.mistral_calls import MistralCallReader
from launcher.serving.pythonic_calls import PythonicCallReader
from launcher.serving.responses import chat_body
from launcher.serving.tool_calls import ToolCallReader
from tests.call_reader_checks import random_cuts, reassembled

NOT_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1.5E+999", "1" * 400 + ".0"]
"""Numbers Python's decoder took (or read as infinity) that no JSON writes back."""
FINITE = ["1e-400", "2.5e3", "-0.0", "1" + "0" * 400]
"""Numbers that stay: underflow reads as 0.0, and an integer is exact however long."""

JSON_READERS = {  # each format's call around `arguments` (JSON text), the arguments before the name
    "hermes": (HermesCallReader, lambda arguments: f'<tool_call>{{"arguments": {arguments}, "name": "f"}}</tool_call>'),
    "llama3_json": (Llama3JsonCallReader, lambda arguments: f'{{"parameters": {arguments}, "name": "f"}}'),
    "mistral": (MistralCallReader, lambda arguments: f'[TOOL_CALLS][{{"arguments": {arguments}, "name": "f"}}]'),
}


def assert_strict_json(text: str) -> None:
    """The text is RFC 8259's JSON, as JSON.parse or serde read it: no NaN, no Infinity (integers of
    any length, which Python's decoder limits, read as their text)."""
    def refuse(constant: str):
        raise AssertionError(f"{constant} is no JSON: {text[:80]}")
    json.loads(text, parse_constant=refuse, parse_int=str)


def streamed(reader, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """(content, calls) the reader streams for the text cut at `cuts`."""
    edges = [0, *cuts, len(text)]
    deltas = [reader.delta(text[a:b], b == len(text)) for a, b in zip(edges, edges[1:])]
    return ("".join(d.get("content") or "" for d in deltas),
            [c["function"] for c in reassembled([c for d in deltas for c in d.get("tool_calls", [])])])


def splits(text: str, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[], list(range(1, len(text)))] + [random_cuts(rng, text) for _ in range(30)]


# ---- F1: numbers no JSON writes ---------------------------------------------------------------------
@pytest.mark.parametrize("number", NOT_FINITE)
def test_a_number_no_json_writes_is_no_json_value_here(number):
    text = '{"a": [1, %s]}' % number
    assert loads_or_none(text) is None and decode_at(text) is None and shape_or_none(text) is None
    with pytest.raises(ValueError):
        arguments_text({"a": float(number.replace("Infinity", "inf"))})  # json.dumps wrote Infinity


@pytest.mark.parametrize("number", FINITE)
def test_finite_numbers_and_long_integers_stay(number):
    value = loads_or_none('{"a": %s}' % number)
    assert value == {"a": json.loads(number)} and json.loads(arguments_text(value)) == value
    assert_strict_json(arguments_text(value))


@pytest.mark.parametrize("parser", JSON_READERS)
@pytest.mark.parametrize("number", NOT_FINITE)
def test_json_formats_read_a_non_finite_number_as_no_call_whole_and_streamed(parser, number):
    """The arguments come before the name, so no stream announces the call before the number: whole
    and streamed, over any split, the text is all content and no call goes out."""
    reader_class, form = JSON_READERS[parser]
    text = form('{"a": %s, "b": 2}' % number)
    whole = reader_class()
    whole.push(text, True)
    assert whole.message() == {"role": "assistant", "content": text}  # was a call, arguments NaN/Infinity
    for cuts in splits(text, len(number)):
        assert streamed(reader_class(), text, cuts) == (text, []), cuts


NAMED_FIRST = {  # the call's name before its arguments
    "hermes": (HermesCallReader, '<tool_call>{"name": "f", "arguments": {"a": 1e400}}</tool_call>'),
    "llama3_json": (Llama3JsonCallReader, '{"name": "f", "parameters": {"a": 1e400}}'),
    "mistral": (MistralCallReader, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1e400}}]'),
}


@pytest.mark.parametrize("parser", NAMED_FIRST)
def test_json_formats_never_stream_a_non_finite_number(parser):
    """Named first, the call may go out before the number comes (the readers' documented exception:
    the whole answer is content); nothing of the number goes out in its arguments, at any split."""
    reader_class, text = NAMED_FIRST[parser]
    whole = reader_class()
    whole.push(text, True)
    assert "tool_calls" not in whole.message()
    for cuts in splits(text, 3):
        content, calls = streamed(reader_class(), text, cuts)
        assert content == text and [c["name"] for c in calls] in ([], ["f"]), (calls, cuts)
        assert all('{"a": '.startswith(c["arguments"]) for c in calls), (calls, cuts)  # at most what came before


@pytest.mark.parametrize("parser", NAMED_FIRST)
@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
def test_arguments_that_are_a_non_finite_number_announce_no_call(parser, number):
    """A call goes out with its arguments' first text: a bare number is held until it ends, so one
    that is no JSON is never announced, whole and streamed alike, at any split."""
    reader_class, text = NAMED_FIRST[parser]
    text = text.replace('{"a": 1e400}', number)
    for cuts in splits(text, 9):
        assert streamed(reader_class(), text, cuts) == (text, []), cuts


def test_pythonic_reads_a_number_beyond_a_double_as_no_call():
    for text in ("[f(a=1e400)]", "[f(a=-1e400)]", "[f(a=[1, 2e999])]"):
        whole = PythonicCallReader()
        whole.push(text, True)
        assert whole.message() == {"role": "assistant", "content": text}  # was {"a": Infinity}
        for cuts in splits(text, 5):
            content, calls = streamed(PythonicCallReader(), text, cuts)
            assert content == text and all("Infinity" not in c["arguments"] for c in calls), cuts


def read_required(text: str) -> tuple[dict, str | None, list[dict], str | None]:
    """(the whole answer's message and finish reason, the calls the stream sent and its finish), the
    stream fed 7 characters at a time."""
    whole = ToolCallReader("required")
    whole.push(text, True)
    stream = ToolCallReader("required")
    deltas = [stream.delta(text[i:i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    sent = [c["function"] for c in reassembled([c for d in deltas for c in d.get("tool_calls", [])])]
    return whole.message(), whole.finish_reason("stop"), sent, stream.finish_reason("stop")


@pytest.mark.parametrize("number", NOT_FINITE[3:])  # the grammar writes numbers, not NaN or Infinity
def test_required_reads_a_number_beyond_a_double_as_no_call(number):
    """The whole answer has no call (it wrote Infinity); the stream announced the call before the
    number (as at the depth limit), and sends nothing from the number on, nor any later call."""
    text = '[{"name": "f", "parameters": {"a": %s}}, {"name": "g", "parameters": {}}]' % number
    message, finish, sent, stream_finish = read_required(text)
    assert message == {"role": "assistant", "content": ""} and finish == "stop"
    assert sent == [{"name": "f", "arguments": '{"a": '}] and stream_finish == "tool_calls"


# ---- F2: "required" whole and streamed alike --------------------------------------------------------
@pytest.mark.parametrize("text", [
    '[{"name": "f", "parameters": {"a": 1' + "0" * 4400 + '}}]',  # past Python's digit limit
    '[{"name": "f", "parameters": {"a":1,"b" : [2.5e3, -0.0, "é"]}}, {"name": "g", "parameters": {}}]',
    '[{"parameters": {"n": -' + "9" * 5000 + '}, "name": "g"}]',
])
def test_required_keeps_every_call_its_stream_sends_with_the_same_arguments(text):
    message, finish, sent, stream_finish = read_required(text)
    assert [c["function"] for c in message["tool_calls"]] == sent and finish == stream_finish == "tool_calls"
    for call in sent:
        assert_strict_json(call["arguments"])


# ---- F3, F4: arguments in the conversation's history ------------------------------------------------
def history(arguments: str, name: str = "f") -> dict:
    return {"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def template_arguments(body: dict) -> dict:
    request = proto.parse_request(proto.ChatCompletionRequest, body, None)
    return request.messages[1]._template_calls[0]["function"]["arguments"]


@pytest.mark.parametrize("arguments", ['{"a": 1' + "0" * 5000 + "}", '{"a": NaN}', '{"a": 1e400}'])
def test_unreadable_history_arguments_are_read_as_an_empty_object(arguments):
    """A 5000-digit integer raised a plain ValueError (a 500); it and the numbers no JSON writes read
    as {}, as text that encodes no object does (vLLM's reading)."""
    assert template_arguments(history(arguments)) == {}
    chat, _ = chat_body({"model": "m", "input": [  # the Responses API's function_call item, the same path
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    assert template_arguments(chat) == {}


def test_this_servers_own_answer_with_a_lone_surrogate_escape_can_be_sent_back():
    """Our hermes answer writes the model's "\\ud83d" escaped; the next turn sending it back was a 400
    naming an offset in an internal dump. The template gets the escape's text."""
    reader = HermesCallReader()
    reader.push('<tool_call>{"name": "f", "arguments": {"s": "a\\ud83d", "\\udc00k": ["\\ud83d\\ude00"]}}'
                '</tool_call>', True)
    arguments = reader.message()["tool_calls"][0]["function"]["arguments"]
    assert template_arguments(history(arguments)) == {"s": "a\\ud83d", "\\udc00k": ["\U0001f600"]}


def test_a_call_name_or_id_that_is_no_text_is_refused_naming_that_field():
    with pytest.raises(proto.ProtocolError) as refused:
        template_arguments(history("{}", name="f\ud83d"))
    assert refused.value.param == "messages.1.tool_calls.0.function.name"
    body = history("{}")
    body["messages"][1]["tool_calls"][0]["id"] = "c\udc00"
    with pytest.raises(proto.ProtocolError) as refused:
        template_arguments(body)
    assert refused.value.param == "messages.1.tool_calls.0.id"


# ---- F5: tool_choice of another type ----------------------------------------------------------------
@pytest.mark.parametrize("choice", [{"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
                                    {"type": "custom", "custom": {"name": "f"}}])
def test_a_tool_choice_of_another_type_is_refused_by_its_type(choice):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": choice}
    with pytest.raises(proto.ProtocolError) as refused:
        proto.parse_request(proto.ChatCompletionRequest, body, "hermes")
    message = str(refused.value)
    assert refused.value.param == "tool_choice.type" and repr(choice["type"]) in message
    assert 'must be "function"' in message and '"required"' in message and "is required" not in message


# ---- F6: pythonic dict keys and sets ----------------------------------------------------------------
@pytest.mark.parametrize("value", ['{1: "x", "1": "y"}', "{1.0: 2, 1: 3}", "{-1: 1}", "{1: 1}", "{None: 1}",
                                   "{True: 1}", "{1, 2}", '{"a", "b"}', '{"a": {2}}'])
def test_a_pythonic_dict_key_that_is_no_string_or_a_set_is_no_call(value):
    text = f"[f(o={value})]"
    whole = PythonicCallReader()
    whole.push(text, True)
    assert whole.message() == {"role": "assistant", "content": text}
    for cuts in splits(text, 11):  # announced at its `(`, the call sends no argument
        assert streamed(PythonicCallReader(), text, cuts) == (text, [{"name": "f", "arguments": "{"}]), cuts


def test_pythonic_string_keys_stay():
    whole = PythonicCallReader()
    whole.push('[f(o={"a": 1, ("b"): {"c": []}})]', True)
    assert whole.message()["tool_calls"][0]["function"]["arguments"] == '{"o": {"a": 1, "b": {"c": []}}}'


def test_required_an_element_without_parameters_is_read_as_its_stream_reads_it():
    """The output's schema requires "parameters"; without them (no grammar) the whole answer wrote
    the arguments "null" while the stream never sent the call: now neither sends it, nor the calls
    after it (a stream cannot send them before it)."""
    message, finish, sent, stream_finish = read_required('[{"name": "f"}, {"name": "g", "parameters": {}}]')
    assert message == {"role": "assistant", "content": ""} and sent == [] and finish == stream_finish == "stop"
