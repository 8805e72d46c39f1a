"""A streamed /v1/responses answer ends with the whole answer's items: the final event's output
(response.completed or response.incomplete) and the turn kept for previous_response_id are what
the same request answered whole gives (launcher/serving/openai_app.py, _response_events: the answer
is read whole at its end). Cut by max_output_tokens inside a second call, the stream's reader had
announced the first call and then turned only the second back into text, closing the first as
incomplete and dropping it with its text: the final response and the kept turn lost a valid call
(hermes), or held text the whole answer reads as calls, for every parser."""

from __future__ import annotations

import pytest

from tests.test_kept_responses import keeping, read_back
from tests.test_responses_route import TOOLS, WEATHER_CALL, asked, check_with_the_clients_types, respond, said
from tests.test_responses_route import tokenizer  # noqa: F401  (the module-scoped fixture)

QWEN_CALL = "<tool_call>\n<function=weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>"

TWO_CALLS = {
    "hermes": "A" + WEATHER_CALL + "\n" + WEATHER_CALL.replace("Paris", "Rome"),
    "llama3_json": '{"name": "weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "weather", "parameters": {"city": "Rome"}}',
    "pythonic": '[weather(city="Paris"), weather(city="Rome")]',
    "qwen3_coder": "Ok." + QWEN_CALL.format("Paris") + "\n" + QWEN_CALL.format("Rome"),
    "mistral": '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, '
               '{"name": "weather", "arguments": {"city": "Rome"}}]',
}


def streamed_items(events: list[dict]) -> list[dict]:
    return [event["item"] for event in events if event["type"] == "response.output_item.done"]


@pytest.mark.parametrize("parser", sorted(TWO_CALLS))
def test_a_streamed_answer_ends_with_the_whole_answers_items_at_every_cut(tokenizer, parser):
    script = TWO_CALLS[parser]
    server = keeping(tokenizer, script, tool_call_parser=parser)  # it answers the script to every request
    length = len(tokenizer.encode(script, add_special_tokens=False))
    for limit in [*range(1, length), None]:  # every cut, then the answer uncut
        cut = {} if limit is None else {"max_output_tokens": limit}
        whole = respond(server, asked(tools=TOOLS, **cut))
        events = respond(server, asked(tools=TOOLS, stream=True, **cut))
        check_with_the_clients_types(events)
        final = events[-1]["response"]
        assert events[-1]["type"] == ("response.completed" if limit is None else "response.incomplete"), limit
        assert said(final["output"]) == said(whole["output"]), (parser, limit)
        assert read_back(server, final["id"])["output"] == final["output"], (parser, limit)
        # a call the stream announced keeps its ids in the final response: the client answers by that call_id
        told = {(item["name"], item["arguments"]): (item["id"], item["call_id"])
                for item in streamed_items(events) if item["type"] == "function_call"}
        for item in final["output"]:
            if item["type"] == "function_call" and (item["name"], item["arguments"]) in told:
                assert (item["id"], item["call_id"]) == told[item["name"], item["arguments"]], (parser, limit)
    assert [item["type"] for item in final["output"]].count("function_call") == 2  # the uncut answer's two calls
    assert final["output"] == streamed_items(events)  # uncut, the final response is the items streamed


@pytest.mark.parametrize("parser, script", [
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city":"Paris"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}, "arguments": {"city": "Rome"}}'
               '\n</tool_call>'),
    ("llama3_json", '{"name": "weather", "parameters": {"city":"Paris"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"city":"Paris"}}]'),
])
def test_a_call_written_otherwise_than_json_dumps_keeps_its_streamed_call_id(tokenizer, parser, script):
    """The whole answer writes a call's arguments as json.dumps does and the stream as the model wrote
    them (compact; a repeated key, the stream taking the first): matched by text, the final item and
    the kept turn had a call_id the client never saw, and its next turn's function_call_output was
    refused ("No tool call found")."""
    server = keeping(tokenizer, script, tool_call_parser=parser)
    events = respond(server, asked(tools=TOOLS, stream=True))
    told = [e["item"]["call_id"] for e in events
            if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    final = events[-1]["response"]
    kept = read_back(server, final["id"])["output"]
    assert len(told) == 1, told
    assert [i["call_id"] for i in final["output"] if i["type"] == "function_call"] == told
    assert [i["call_id"] for i in kept if i["type"] == "function_call"] == told


@pytest.mark.parametrize("script", [
    # the first call's repeated key: the stream reads Paris, the whole answer Rome, as the second call
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}, "arguments": {"city": "Rome"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    '<tool_call>\n{"name": "weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "weather", "arguments": {"city":"Rome"}}\n</tool_call>',
])
def test_two_calls_keep_their_own_streamed_call_ids_in_order(tokenizer, script):
    """Matched by text or JSON value, the first whole-answer call above took the second streamed
    call's call_id (its value read the same), and the second kept one the client never saw."""
    server = keeping(tokenizer, script, tool_call_parser="hermes")
    events = respond(server, asked(tools=TOOLS, stream=True))
    told = [e["item"]["call_id"] for e in events
            if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    final = events[-1]["response"]
    assert len(told) == 2, told
    assert [i["call_id"] for i in final["output"] if i["type"] == "function_call"] == told
    assert [i["call_id"] for i in read_back(server, final["id"])["output"] if i["type"] == "function_call"] == told


def test_a_call_the_stream_never_told_keeps_its_own_id_and_the_next_one_its_streamed_one():
    """Where the stream told fewer calls of a name than the whole answer holds, pairing by name alone
    gave the untold call the next one's call_id; by JSON value, in order, each gets its own."""
    from launcher.serving.responses.output import _with_streamed_ids

    def call(item_id: str, call_id: str, arguments: str) -> dict:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": "weather",
                "arguments": arguments, "status": "completed"}

    whole = [call("fc_w1", "W1", '{"city": "Paris"}'), call("fc_w2", "W2", '{"city": "Rome"}')]
    streamed = [call("fc_s2", "S_ROME", '{"city":"Rome"}')]
    assert [item["call_id"] for item in _with_streamed_ids(whole, streamed)] == ["W1", "S_ROME"]
