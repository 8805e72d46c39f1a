"""Edges of POST /v1/responses and of the chat stream it shares its readers with: a call the hermes
reader turns back into text (the length limit cutting its JSON) is neither told as a call nor kept
for the next turn; a stream_interval's gathered deltas tell calls and text in the order the text
has them, the chat stream as the Responses stream. Over the route's scripted server
(tests/test_responses_route.py), its deltas gathered as a stream_interval gathers them
(launcher/serving/text_stream.merged)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from launcher.serving.text_stream import merged
from tests.test_kept_responses import keeping, read_back, refusal_by
from tests.test_responses_api import check_stream
from tests.test_responses_route import (MODEL, TOOLS, WEATHER_CALL, asked, refusal, respond, said, server_over,
                                        tokenizer)
from tests.test_tokenize_routes import post, streamed_text_of

__all__ = ["tokenizer"]  # the module-scoped fixture, taken from the route's tests

SCRIPT = "Let me look." + WEATHER_CALL
INTERVALS = (1, 2, 4, 8)
CALL_BEGINS = 4
"""A length limit, in tokens, that the script's text alone fills ("Let me look." is 4 of SmolLM2's)."""


def gathering(server, interval: int):
    """The server with its engine's deltas joined `interval` at a time (the last ones fewer), as
    --stream-interval joins them."""
    one_by_one = server.launcher.astream

    def astream(*args, **options):
        async def deltas():
            held = []
            async for delta in one_by_one(*args, **options):
                held.append(delta)
                if len(held) == interval or delta.finish_reason:
                    yield merged(held)
                    held = []
        return deltas()

    server.launcher = SimpleNamespace(**{**vars(server.launcher), "astream": astream})
    return server


def chat(server, body: dict):
    """The chat route's whole answer (a dict), or its stream's chunks' deltas (a list)."""
    async def run():
        response = await server.chat_completions(post("/v1/chat/completions", body))
        if not body.get("stream"):
            return json.loads(response.body)
        text = await streamed_text_of(response)
        return [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in text.split("\n\n")
                if line.startswith("data: {")]
    return asyncio.run(run())


def chat_asked(limit: int, **fields) -> dict:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": TOOLS[0]["parameters"]}}]
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": limit,
            **fields}


def streamed_calls(deltas: list[dict]) -> tuple[str, list[tuple[str, str]], dict[int, int], int | None]:
    """(the content, the calls as (name, arguments), the chunk each call was announced in, the
    first chunk with content after a call was announced) of a chat stream's deltas."""
    content, calls, announced, content_after = "", {}, {}, None
    for n, delta in enumerate(deltas):
        for entry in delta.get("tool_calls") or []:
            if "id" in entry:
                announced[entry["index"]] = n
            name, arguments = calls.get(entry["index"], ("", ""))
            function = entry.get("function") or {}
            calls[entry["index"]] = (name + (function.get("name") or ""), arguments + (function.get("arguments") or ""))
        if delta.get("content"):
            content += delta["content"]
            if announced and content_after is None:
                content_after = n
    return content, [call for _, call in sorted(calls.items())], announced, content_after


def test_the_chat_stream_says_the_whole_answer_at_every_interval(tokenizer):
    """At every stream interval and every length cut, the chat stream's content is the whole answer's
    and its calls are the whole answer's, but for one it cannot take back: a call announced in an
    earlier chunk that the cut then broke (the whole answer is all text; the stream goes on with the
    call's text as content). No chunk announces a call and tells it as content too (a gathered
    delta read whole did: its content was the call's text, and the call came with it)."""
    tokens = len(tokenizer.encode(SCRIPT, add_special_tokens=False))
    # one server each, answering the script to every request (a server's start reads the tokenizer)
    whole_server = server_over(tokenizer, SCRIPT, "hermes")
    gathered = {interval: gathering(server_over(tokenizer, SCRIPT, "hermes"), interval) for interval in INTERVALS}
    for limit in range(CALL_BEGINS, tokens + 1):  # before the call, the answer is text alone
        whole = chat(whole_server, chat_asked(limit))["choices"][0]["message"]
        whole_calls = [(call["function"]["name"], call["function"]["arguments"])
                       for call in whole.get("tool_calls") or []]
        for interval in INTERVALS:
            deltas = chat(gathered[interval], chat_asked(limit, stream=True))
            content, calls, announced, content_after = streamed_calls(deltas)
            where = (interval, limit)
            assert content == (whole["content"] or ""), where
            if calls != whole_calls:  # only a call announced before the chunk that took it back
                assert not whole_calls and content_after is not None, where
                assert all(chunk < content_after for chunk in announced.values()), where
            else:
                assert content_after is None, where


def test_the_responses_stream_ends_with_the_whole_answers_items_at_every_interval(tokenizer):
    """Gathered deltas are read a part at a time: the Responses stream's final items are the whole
    answer's at every interval and cut (a gathered delta read whole told its call's text as content
    before the call it had opened: a message, then a call the whole answer has not)."""
    tokens = len(tokenizer.encode(SCRIPT, add_special_tokens=False))
    whole_server = server_over(tokenizer, SCRIPT, "hermes")  # one server each, as above
    gathered = {interval: gathering(server_over(tokenizer, SCRIPT, "hermes"), interval) for interval in INTERVALS[1:]}
    for limit in range(CALL_BEGINS, tokens + 1):
        whole = respond(whole_server, asked(tools=TOOLS, max_output_tokens=limit))
        for interval in INTERVALS[1:]:
            events = respond(gathered[interval], asked(tools=TOOLS, max_output_tokens=limit, stream=True))
            check_stream(events)  # the client's types and accumulator; the events add up to the final items
            assert said(events[-1]["response"]["output"]) == said(whole["output"]), (interval, limit)


def test_a_call_the_cut_broke_is_not_kept_for_the_next_turn(tokenizer):
    """A streamed turn whose call the length limit broke is kept as its final event tells it: one
    message, no call, so the next turn's prompt holds the text and no call with broken arguments."""
    server = keeping(tokenizer, [SCRIPT, "Sunny."], tool_call_parser="hermes")
    events = respond(server, asked(tools=TOOLS, max_output_tokens=21, stream=True))
    broken = [event["item"] for event in events if event["type"] == "response.output_item.done"
              and event["item"]["type"] == "function_call"]
    assert [call["status"] for call in broken] == ["incomplete"]  # it had been opened, and is closed so
    respond(server, asked(tools=TOOLS, input="and?", previous_response_id=events[-1]["response"]["id"]))
    assert "(call" not in server.prompts[-1] and '{"city":' in server.prompts[-1]


LONE_SURROGATE = "\ud800"
"""JSON can carry it ("\\ud800"); no UTF-8 text can, so no response echoing it could be written."""


@pytest.mark.parametrize("fields, param", [
    ({"user": LONE_SURROGATE}, "user"),
    ({"prompt_cache_key": LONE_SURROGATE}, "prompt_cache_key"),
    ({"safety_identifier": LONE_SURROGATE}, "safety_identifier"),
    ({"metadata": {"k": LONE_SURROGATE}}, "metadata.k"),
    ({"metadata": {LONE_SURROGATE: "v"}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "description": LONE_SURROGATE,
                          "schema": {"type": "object"}}}}, "text.format.description"),
    ({"input": [{"role": "user", "content": "x", "id": LONE_SURROGATE}]}, "input[0].id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "weather", "arguments": "{}",
                 "id": LONE_SURROGATE}]}, "input[0].id"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_echoed_text_no_utf8_can_carry_is_refused_before_generating(tokenizer, fields, param, stream):
    """Fields the response echoes (or a kept turn lists back) holding a lone surrogate: a 400 naming
    the field, before anything is generated (it was a 500 once the answer was made, and a kept
    turn's every later read failed)."""
    server = keeping(tokenizer, "Hi there.")
    refused = refusal(server, asked(stream=stream, **fields))
    assert refused.status == 400 and refused.param == param and "not valid UTF-8" in refused.message
    assert server.prompts == [] and len(server.responses_kept.store) == 0


def test_a_failed_stream_says_it_is_not_kept_and_its_404_says_why(tokenizer):
    """A stream that fails after it began is never kept: response.failed says store false, and
    reading it back is a 404 whose reasons name a failed response."""
    from launcher.errors import RequestTimeout

    server = keeping(tokenizer, "The sky is blue.")
    scripted = server.launcher.astream

    def times_out(*args, **kwargs):
        async def deltas():
            async for delta in scripted(*args, **kwargs):
                yield delta
                raise RequestTimeout("request r did not finish within 4 s")
        return deltas()

    server.launcher.astream = times_out
    events = respond(server, asked(stream=True))
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["store"] is False
    missing = refusal_by(read_back, server, events[-1]["response"]["id"])
    assert missing.status == 404 and "failed or was cut off before it finished" in missing.message


def test_a_function_call_output_must_answer_a_call_made_before_it(tokenizer):
    """OpenAI's rule: an output whose call_id no earlier function_call has is refused, naming its
    call_id; a call in the turn previous_response_id continues counts."""
    call = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"}
    answers = {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}
    for given, at in (([answers], 0), ([{**call, "call_id": "call_2"}, answers], 1), ([answers, call], 0)):
        refused = refusal(server_over(tokenizer, "Fine.", "hermes"), asked(input=given, tools=TOOLS))
        assert refused.status == 400 and refused.param == f"input[{at}].call_id", given
        assert "No tool call found for function call output with call_id 'call_1'" in refused.message
    server = keeping(tokenizer, [WEATHER_CALL, "Sunny."], tool_call_parser="hermes")
    first = respond(server, asked(tools=TOOLS))
    [made] = [item for item in first["output"] if item["type"] == "function_call"]
    respond(server, asked(tools=TOOLS, previous_response_id=first["id"],
                          input=[{**answers, "call_id": made["call_id"]}]))
    assert f"(for {made['call_id']})" in server.prompts[-1]


def test_reasonings_older_summary_name_is_checked_beside_a_null_summary(tokenizer):
    refused = refusal(server_over(tokenizer, "Fine."), asked(reasoning={"summary": None, "generate_summary": "bogus"}))
    assert refused.status == 400 and refused.param == "reasoning.generate_summary" and "'bogus'" in refused.message
    answer = respond(server_over(tokenizer, "Fine."), asked(reasoning={"summary": None, "generate_summary": "auto"}))
    assert answer["reasoning"]["summary"] == "auto"


def test_cancelling_a_response_says_none_runs_in_the_background(tokenizer):
    """OpenAI's POST /v1/responses/{id}/cancel: a 400 saying why, where it was a plain 404 (no route)."""
    from tests.test_kept_responses import request_to

    server = keeping(tokenizer, "Fine.")
    kept = respond(server, asked())["id"]
    cancel = request_to("POST", f"/v1/responses/{kept}/cancel")
    refused = refusal_by(lambda: asyncio.run(server.cancel_response(kept, cancel)))
    assert refused.status == 400 and refused.param == "response_id"
    assert "only background responses can be cancelled" in refused.message


def test_an_item_the_continued_conversation_holds_is_not_taken_twice(tokenizer):
    """OpenAI's rule: an input item whose id a kept turn already has is refused (sent back with
    previous_response_id, the earlier answer came twice into the prompt)."""
    server = keeping(tokenizer, ["Blue.", "Grey."])
    first = respond(server, asked())
    refused = refusal(server, asked(previous_response_id=first["id"],
                                    input=[*first["output"], {"role": "user", "content": "And now?"}]))
    assert refused.status == 400 and refused.param == "input[0].id" and "Duplicate item found" in refused.message
    respond(server, asked(previous_response_id=first["id"], input="And now?"))
    assert server.prompts[-1].count("Blue.") == 1
