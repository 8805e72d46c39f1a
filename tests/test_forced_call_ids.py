"""The ids of forced calls (tool_choice "required" or a named function) take the form of the server's
tool-call parser where its model's chat template checks them (launcher/serving/tool_calls.py
PARSER_CALL_IDS): on a `--tool-call-parser mistral` server they are 9 letters and digits, as "auto"
calls are there, whole and streamed; Mistral's templates refuse any other id on the next turn."""

from __future__ import annotations

import re

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]
BASE = {"model": "m", "messages": [{"role": "user", "content": "Call a tool."}], "tools": TOOLS}
REQUIRED_TEXT = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
NAMED = {"type": "function", "function": {"name": "f"}}
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
DEFAULT_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


def forced_reader(choice, parser):
    return parse_request(ChatCompletionRequest, {**BASE, "tool_choice": choice}, parser).tool_call_reader()


def ids_whole(choice, parser, text):
    reader = forced_reader(choice, parser)
    reader.push(text, True)
    return [call["id"] for call in reader.message()["tool_calls"]]


def ids_streamed(choice, parser, text):
    """The ids the stream's entries carry, each piece a few characters, and the message's after it."""
    reader = forced_reader(choice, parser)
    sent = []
    for start in range(0, len(text), 3):
        delta = reader.delta(text[start:start + 3], start + 3 >= len(text))
        sent += [entry["id"] for entry in delta.get("tool_calls", []) if "id" in entry]
    assert sent == [call["id"] for call in reader.message()["tool_calls"]]  # the message keeps the sent ids
    return sent


@pytest.mark.parametrize("choice, text, count", [("required", REQUIRED_TEXT, 2), (NAMED, '{"a": 1}', 1)])
@pytest.mark.parametrize("read", [ids_whole, ids_streamed])
def test_forced_calls_on_a_mistral_server_get_mistral_ids(choice, text, count, read):
    ids = read(choice, "mistral", text)
    assert len(ids) == count and all(MISTRAL_ID.fullmatch(call_id) for call_id in ids), ids
    assert len(set(ids)) == count


@pytest.mark.parametrize("parser", [None, "hermes", "llama3_json", "pythonic", "qwen3_coder"])
@pytest.mark.parametrize("choice, text", [("required", REQUIRED_TEXT), (NAMED, '{"a": 1}')])
@pytest.mark.parametrize("read", [ids_whole, ids_streamed])
def test_forced_calls_on_other_servers_keep_vllms_default_ids(parser, choice, text, read):
    ids = read(choice, parser, text)
    assert ids and all(DEFAULT_ID.fullmatch(call_id) for call_id in ids), ids


def test_each_parser_with_its_own_ids_is_a_parser_the_server_takes():
    from launcher.serving.server_settings import TOOL_CALL_PARSERS
    from launcher.serving.tool_calls import PARSER_CALL_IDS, call_id_maker

    assert set(PARSER_CALL_IDS) <= set(TOOL_CALL_PARSERS)
    assert MISTRAL_ID.fullmatch(call_id_maker("mistral")())
