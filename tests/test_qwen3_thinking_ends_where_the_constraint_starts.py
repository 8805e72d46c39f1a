"""qwen3's split of a constrained answer (a forced tool call, named or "required", response_format,
structured_outputs) agrees with its constraint: the engine's grammar starts only after the `</think>`
token (openai_protocol's settle_thinking), so the thinking ends there alone. A `<tool_call>` the model
writes while thinking is unconstrained text: it stays reasoning, neither the call's arguments nor the
answer's JSON; and the answer, which the grammar wrote, is kept as written (a `</think>` in it stays).
Free answers keep qwen3's own rule (tests/test_reasoning.py). The chat route runs in-process over
SmolLM2's tokenizer with the tags added as one token each (as Qwen3's has them), and a stub engine
that streams a scripted text one token a delta: the text the grammar lets through."""

from __future__ import annotations

import json

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
from launcher.serving import reasoning
from tests.call_reader_checks import reassembled
from tests.test_reasoning_usage import answer, details, server_over, tagged, tokens  # noqa: F401 (a fixture)

MODEL = "smollm2-135m-instruct"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
THOUGHT = 'I will call it.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call> No: Paris.'
"""Thinking that writes a call before its `</think>`: the grammar was not on yet."""
SCHEMA = {"type": "json_schema", "json_schema": {"name": "snippet", "schema": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def asked(**fields) -> dict:
    # the prompt leaves the thinking open (qwen3's model writes `<think>` itself)
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "chat_template_kwargs": {"opening": ""}, **fields}


def both(tokenizer, script: str, **fields) -> tuple[dict, dict, list[dict]]:
    """(the whole answer's choice, its usage, the streamed chunks' choices) of `script` under qwen3."""
    whole = answer(server_over(tokenizer, "qwen3", [script]), asked(**fields))
    chunks = answer(server_over(tokenizer, "qwen3", [script]),
                    asked(stream=True, stream_options={"include_usage": True}, **fields))
    return whole["choices"][0], whole["usage"], [c for chunk in chunks for c in chunk["choices"]]


def joined(choices: list[dict], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in choices)


def streamed_calls(choices: list[dict]) -> list[dict]:
    return reassembled([call for c in choices for call in c["delta"].get("tool_calls", [])])


@pytest.mark.parametrize("tool_choice, answer_text, finish", [
    (NAMED, '{"city": "Paris"}', "stop"),  # vLLM's finish for a named call
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "tool_calls"),
], ids=["named", "required"])
def test_a_forced_call_written_while_thinking_stays_reasoning(tagged, tool_choice, answer_text, finish):
    choice, usage, streamed = both(tagged, f"<think>{THOUGHT}</think>{answer_text}", tools=TOOLS,
                                   tool_choice=tool_choice)
    message = choice["message"]
    assert message["reasoning"] == THOUGHT and joined(streamed, "reasoning") == THOUGHT
    for calls in (message["tool_calls"], streamed_calls(streamed)):
        [call] = calls
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == streamed[-1]["finish_reason"] == finish
    # the count goes on through the `<tool_call>` token to `</think>`
    assert details(usage) == {"reasoning_tokens": tokens(tagged, THOUGHT)}


def test_a_json_schema_answer_after_a_call_written_while_thinking(tagged):
    script = f'<think>{THOUGHT}</think>{{"code": "print(1)"}}'
    choice, usage, streamed = both(tagged, script, response_format=SCHEMA)
    assert choice["message"]["reasoning"] == THOUGHT and joined(streamed, "reasoning") == THOUGHT
    assert choice["message"]["content"] == joined(streamed, "content") == '{"code": "print(1)"}'
    assert details(usage) == {"reasoning_tokens": tokens(tagged, THOUGHT)}


@pytest.mark.parametrize("fields", [{"response_format": SCHEMA}, {"tools": TOOLS, "tool_choice": NAMED}],
                         ids=["json_schema", "named_call"])
def test_a_think_end_the_grammar_wrote_in_the_answer_is_kept(tagged, fields):
    code = "s.split('</think>')"
    script = f'<think>ok</think>{json.dumps({"code": code, "city": "Paris"})}'
    choice, _, streamed = both(tagged, script, **fields)
    assert choice["message"]["reasoning"] == joined(streamed, "reasoning") == "ok"
    if "tools" in fields:
        for calls in (choice["message"]["tool_calls"], streamed_calls(streamed)):
            assert json.loads(calls[0]["function"]["arguments"]) == {"code": code, "city": "Paris"}
    else:
        assert json.loads(choice["message"]["content"])["code"] == code
        assert joined(streamed, "content") == choice["message"]["content"]


def test_a_free_answer_keeps_qwen3s_own_rule(tagged):
    """No structured output: a `<tool_call>` still ends the thinking, a later `</think>` is dropped."""
    choice, usage, streamed = both(tagged, "<think>hm<tool_call>x</think>y")
    assert choice["message"]["reasoning"] == joined(streamed, "reasoning") == "hm"
    assert choice["message"]["content"] == joined(streamed, "content") == "<tool_call>xy"
    assert details(usage) == {"reasoning_tokens": tokens(tagged, "hm")}


def test_which_requests_read_their_answer_as_constrained():
    def settled(**fields) -> ChatCompletionRequest:
        request = parse_request(ChatCompletionRequest, {**asked(), **fields}, None, "qwen3")
        request.settle_thinking(4242, 4241, [1, 2, 3])
        return request

    for fields in ({"response_format": SCHEMA}, {"tools": TOOLS, "tool_choice": NAMED},
                   {"tools": TOOLS, "tool_choice": "required"}, {"structured_outputs": {"regex": "[0-9]+"}}):
        request = settled(**fields)
        assert request.sampling().structured_output.after_token == 4242
        assert request.reasoning() == ("qwen3", True, True)
    assert settled().reasoning() == ("qwen3", True)  # free text: nothing waits for `</think>`
    off = settled(response_format=SCHEMA, chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning() == ("qwen3", False)  # no thinking to wait for: all content, constrained at once


def test_the_constrained_split_streams_as_it_reads_whole_over_every_cut():
    for text in (f"<think>{THOUGHT}</think>{{}}", "a<think>b<tool_call>c</think>d</think>e<think>f",
                 "x<tool_call>y", "<tool_cal", "</think></think>", "a</thin"):
        whole = tuple(part or "" for part in reasoning.read_reasoning("qwen3", text, True, True))
        for step in (1, 2, 3, 7):
            splitter = reasoning.reasoning_splitter("qwen3", True, True)
            pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
            sent = [splitter.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
            assert ("".join(r for r, _ in sent), "".join(c for _, c in sent)) == whole, (text, step)
