"""The Responses stream finishes each output item before it adds the next
(launcher/serving/responses/output.py, ResponseEvents), as OpenAI streams them and the README
promises: two parallel function calls read by the hermes parser are each added, given their
arguments and done in turn (the first call's done events came after the second's added); and a
chat delta carrying an open call's last argument piece with reasoning gives the piece to the call
before the reasoning closes it (it made the stream fail: the piece found no open call)."""

from __future__ import annotations

import json

from launcher.serving.responses import ResponseEvents, chat_body, usage
from tests.test_responses_api import CHAT_USAGE, check_stream
from tests.test_responses_route import TOOLS, WEATHER_CALL, asked, check_with_the_clients_types, respond, server_over
from tests.test_responses_route import tokenizer  # noqa: F401  (the module-scoped fixture)

ITEM_EVENTS = ("response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done")


def item_by_item(events: list[dict]) -> list[tuple[str, int]]:
    """The item events as (type, output_index), repeated deltas of one item told once."""
    told = []
    for event in events:
        if event["type"] in ITEM_EVENTS and (event["type"], event["output_index"]) not in told[-1:]:
            told.append((event["type"], event["output_index"]))
    return told


def test_two_parallel_calls_are_streamed_one_after_the_other(tokenizer):
    script = WEATHER_CALL + "\n" + WEATHER_CALL.replace("Paris", "Rome")
    events = respond(server_over(tokenizer, script, "hermes"), asked(tools=TOOLS, stream=True))
    check_with_the_clients_types(events)
    assert item_by_item(events) == [(kind, index) for index in (0, 1) for kind in ITEM_EVENTS]
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert [json.loads(item["arguments"]) for item in done] == [{"city": "Paris"}, {"city": "Rome"}]
    assert events[-1]["response"]["output"] == done


def test_a_calls_last_piece_goes_to_it_before_reasoning_in_the_same_delta():
    events = ResponseEvents("resp_1", 1, "m", chat_body({"input": "hi"})[1])
    sent = events.opening()
    sent += events.delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": '}}]})
    sent += events.delta({"reasoning": "hmm", "tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
    sent += events.finish("stop", usage(CHAT_USAGE))
    check_stream(sent)
    output = sent[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "reasoning"]
    assert output[0]["arguments"] == '{"a": 1}' and output[1]["content"][0]["text"] == "hmm"
    assert [event["type"] for event in sent if event["type"] in ("error", "response.failed")] == []
