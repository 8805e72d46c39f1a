"""POST /v1/responses through the server's route (launcher/serving/openai_app.py, over the chat
route's machinery; the Responses shapes in launcher/serving/responses/): a text answer whole
and streamed (the events the official client's types take, the deltas adding up to the whole
answer), instructions and input items reaching the chat template, a length finish as
"incomplete", function calls read by the server's tool-call parser, a thinking model's reasoning
item, and refusals naming the Responses field the client sent. The route runs in-process over
SmolLM2's tokenizer and an engine that streams a scripted text one token a delta."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from launcher.serving.openai_protocol import ProtocolError
from tests.test_tokenize_routes import post, streamed_text_of
from tests.test_tokenize_routes import scripted_server as server_over  # one text for every request, or one each

MODEL = "smollm2-135m-instruct"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.reasoning %}[{{ m.reasoning }}]{% endif %}"
            "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }}){% endfor %}"
            "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{{ opening | default('') }}{% endif %}")
WEATHER_CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "weather", "description": "Today's weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def respond(server, body: dict):
    """The route's Response object, or its stream's events (each SSE's `event:` line checked against
    its data's type)."""
    async def run():
        response = await server.responses(post("/v1/responses", body))
        assert response.status_code == 200
        if not body.get("stream"):
            return json.loads(response.body)
        text = await streamed_text_of(response)
        events = []
        for block in text.split("\n\n")[:-1]:
            name, data = block.split("\n")
            events.append(json.loads(data[len("data: "):]))
            assert name == f"event: {events[-1]['type']}"
        return events

    return asyncio.run(run())


def refusal(server, body: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as refused:
        asyncio.run(server.responses(post("/v1/responses", body)))
    return refused.value


def check_with_the_clients_types(answer) -> None:
    """The official client parses it: a Response, or each event of the stream."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    if isinstance(answer, dict):
        Response.model_validate(answer)
    else:
        adapter = TypeAdapter(ResponseStreamEvent)
        for event in answer:
            adapter.validate_python(event)


def streamed_text(events: list[dict], kind: str = "response.output_text.delta") -> str:
    return "".join(event["delta"] for event in events if event["type"] == kind)


def asked(**fields) -> dict:
    return {"model": MODEL, "input": "What colour is the sky?", **fields}


def test_a_text_answer_whole_and_streamed(tokenizer):
    script = "The sky is blue."
    whole = respond(server_over(tokenizer, script), asked())
    check_with_the_clients_types(whole)
    assert whole["object"] == "response" and whole["status"] == "completed" and whole["model"] == MODEL
    assert whole["id"].startswith("resp_") and whole["incomplete_details"] is None
    [message] = whole["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert [part["text"] for part in message["content"]] == [script]
    usage = whole["usage"]
    assert usage["output_tokens"] == len(tokenizer.encode(script, add_special_tokens=False))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] and usage["input_tokens"] > 0
    events = respond(server_over(tokenizer, script), asked(stream=True))
    check_with_the_clients_types(events)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert streamed_text(events) == script
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"] == usage
    assert [part["text"] for part in final["output"][0]["content"]] == [script]


def test_instructions_and_input_items_reach_the_chat_template(tokenizer):
    server = server_over(tokenizer, "Sunny.")
    respond(server, asked(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"role": "user", "content": [{"type": "input_text", "text": "And"}, {"type": "input_text", "text": "now?"}]}],
        tools=TOOLS, tool_choice="none"))
    [prompt] = server.prompts
    assert prompt.index("<system>Be brief.") < prompt.index("<user>Weather in Paris?")
    assert "(call call_1 weather)" in prompt and "<tool>21 C(for call_1)" in prompt
    # a message's text parts joined by a newline, as vLLM joins them (the template loader trims the
    # newline after a block)
    assert prompt.endswith("<user>And\nnow?<assistant>")


def test_max_output_tokens_cut_is_incomplete(tokenizer):
    script = "The sky is blue today and every day."
    whole = respond(server_over(tokenizer, script), asked(max_output_tokens=3))
    check_with_the_clients_types(whole)
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["usage"]["output_tokens"] == 3 and whole["max_output_tokens"] == 3
    events = respond(server_over(tokenizer, script), asked(max_output_tokens=3, stream=True))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert streamed_text(events) == whole["output"][0]["content"][0]["text"]


def test_a_function_call_read_by_the_servers_parser_whole_and_streamed(tokenizer):
    script = "Let me look." + WEATHER_CALL
    whole = respond(server_over(tokenizer, script, "hermes"), asked(tools=TOOLS))
    check_with_the_clients_types(whole)
    message, call = whole["output"]
    assert message["content"][0]["text"] == "Let me look." and whole["status"] == "completed"
    assert call["type"] == "function_call" and call["name"] == "weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("chatcmpl-tool-")
    assert whole["tools"] == TOOLS and whole["tool_choice"] == "auto"
    events = respond(server_over(tokenizer, script, "hermes"), asked(tools=TOOLS, stream=True))
    check_with_the_clients_types(events)
    assert streamed_text(events) == "Let me look."
    arguments = streamed_text(events, "response.function_call_arguments.delta")
    assert sum(event["type"] == "response.function_call_arguments.delta" for event in events) > 3  # as written
    [done] = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert json.loads(arguments) == json.loads(done["arguments"]) == {"city": "Paris"}
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    assert [item["type"] for item in added] == ["message", "function_call"] and added[1]["name"] == "weather"
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"]
    assert json.loads(final[1]["arguments"]) == {"city": "Paris"}
    # a forced call: no message item, the call alone
    forced = respond(server_over(tokenizer, '{"city": "Rome"}', "hermes"),
                     asked(tools=TOOLS, tool_choice={"type": "function", "name": "weather"}))
    [call] = forced["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Rome"}
    assert forced["tool_choice"] == {"type": "function", "name": "weather"}


def test_a_qwen3_coder_call_takes_its_types_from_the_responses_tools(tokenizer):
    """The Responses route hands its function tools to the reader as the chat route does: the
    qwen3_coder reader types each value by the tool's schema, whole and streamed."""
    tools = [{**TOOLS[0], "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}}}}]
    script = ("<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    whole = respond(server_over(tokenizer, script, "qwen3_coder"), asked(tools=tools))
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "weather"
    assert call["arguments"] == '{"city": "Paris", "days": 3}'
    events = respond(server_over(tokenizer, script, "qwen3_coder"), asked(tools=tools, stream=True))
    check_with_the_clients_types(events)
    assert streamed_text(events, "response.function_call_arguments.delta") == call["arguments"]


def test_a_thinking_models_reasoning_is_its_own_item(tokenizer):
    script = "The sky scatters blue light.</think>Blue."
    body = asked(input=[{"role": "user", "content": "Colour?"}])
    whole = respond(server_over(tokenizer, script, reasoning_parser="deepseek_r1"), body)
    check_with_the_clients_types(whole)
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning"
    assert [part["text"] for part in reasoning["content"]] == ["The sky scatters blue light."]
    assert message["content"][0]["text"] == "Blue."
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = respond(server_over(tokenizer, script, reasoning_parser="deepseek_r1"), {**body, "stream": True})
    check_with_the_clients_types(events)
    assert streamed_text(events, "response.reasoning_text.delta") == "The sky scatters blue light."
    assert streamed_text(events) == "Blue."
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_refusals_name_the_responses_field(tokenizer):
    server = server_over(tokenizer, "x")
    bad = refusal(server, asked(max_output_tokens=0))  # the chat parser's refusal, told in these terms
    assert bad.status == 400 and bad.param == "max_output_tokens" and "max_output_tokens" in bad.message
    unknown = refusal(server, asked(model="other"))
    assert unknown.status == 404 and unknown.param == "model"
    stored = refusal(server, asked(previous_response_id="resp_1"))
    assert stored.status == 400 and stored.param == "previous_response_id"
    builtin = refusal(server, asked(tools=[{"type": "web_search"}]))
    assert builtin.status == 400 and builtin.param.startswith("tools[0]")
    extra = refusal(server, asked(prompt_cache_retention="24h"))  # an unknown parameter (stop is vLLM's, taken)
    assert extra.status == 400 and extra.param == "prompt_cache_retention"
    item = refusal(server, asked(input=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}]))
    assert item.status == 400 and item.param.startswith("input[1]")


def test_a_timeout_names_the_responses_token_limit_whole_and_streamed(tokenizer):
    """A review: a request past the request timeout was told to send max_tokens, which this route
    refuses (it takes max_output_tokens)."""
    from launcher.errors import RequestTimeout

    server = server_over(tokenizer, "The sky is blue.")
    scripted = server.launcher.astream

    async def times_out():
        raise RequestTimeout("request r did not finish within 4 s (it had delivered 1 of 300 tokens); raise "
                             "request_timeout_s (--request-timeout) for long generations")

    server.launcher.astream = first_then(scripted, times_out)

    async def run(stream: bool):
        response = await server.responses(post("/v1/responses", asked(stream=stream, max_output_tokens=300)))
        if not stream:
            return response.status_code, json.loads(response.body)["error"]["message"]
        failed = json.loads((await streamed_text_of(response)).split("\n\n")[-2].split("\n")[1][len("data: "):])
        return failed["type"], failed["response"]["error"]["message"]

    for stream, ending in ((False, 504), (True, "response.failed")):
        got, message = asyncio.run(run(stream))
        assert got == ending
        assert "ask for fewer tokens with max_output_tokens:" in message and "max_tokens (" not in message


async def await_first(deltas):
    """The first of a scripted engine's deltas alone."""
    async for delta in deltas:
        yield delta
        return


def first_then(scripted, then):
    """The scripted engine's astream: its first delta, then `await then()` (raises or never returns)."""
    def astream(*args, **kwargs):
        async def deltas():
            async for delta in await_first(scripted(*args, **kwargs)):
                yield delta
            await then()
        return deltas()
    return astream


def test_the_route_needs_the_api_key(tokenizer):
    from tests.test_tokenize_routes import replica

    refused = refusal(replica(tokenizer, api_key="sk-test"), asked())
    assert refused.status == 401 and refused.code == "invalid_api_key"


def said(output: list[dict]) -> list[tuple]:
    """Output items as what they say, without their ids: (type, status, text or name and arguments)."""
    return [(item["type"], item["status"],
             (item["name"], item["arguments"]) if item["type"] == "function_call"
             else "".join(part["text"] for part in item["content"])) for item in output]


def test_a_stream_cut_inside_a_call_ends_incomplete_at_every_cut(tokenizer):
    """max_output_tokens ending the answer anywhere inside a hermes call: the stream ends with
    response.incomplete (it failed where the cut's last delta carried the call's last piece and its
    text) holding the whole answer's items: where the cut breaks the call's JSON, the reader tells
    its text as content, so the call it had opened is closed as incomplete and left out, and the
    text joins the message before it, as the whole answer's one message."""
    script = "Let me look." + WEATHER_CALL
    server = server_over(tokenizer, script, "hermes")  # it answers the script to every request
    for limit in range(1, len(tokenizer.encode(script, add_special_tokens=False))):
        events = respond(server, asked(tools=TOOLS, max_output_tokens=limit, stream=True))
        check_with_the_clients_types(events)
        assert events[-1]["type"] == "response.incomplete", (limit, [e["type"] for e in events[-3:]])
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        whole = respond(server, asked(tools=TOOLS, max_output_tokens=limit))
        assert said(events[-1]["response"]["output"]) == said(whole["output"]), limit
        # no call is closed as completed unless the whole answer has it
        done_calls = [event["item"] for event in events if event["type"] == "response.output_item.done"
                      and event["item"]["type"] == "function_call" and event["item"]["status"] == "completed"]
        assert said(done_calls) == [entry for entry in said(whole["output"]) if entry[0] == "function_call"
                                    and entry[1] == "completed"], limit


def test_logprobs_asked_by_include_reach_the_message_whole_and_streamed(tokenizer):
    """include "message.output_text.logprobs" (top_logprobs alternatives): the message's text part
    carries every token's, as vLLM's whole answer gives them; streamed, as vLLM streams them, the
    answer's: each output_text delta those of the tokens up to its text, the done event and the final
    response what the deltas carried (not a call's after the text, nor the thinking's).
    top_logprobs alone asks for none (vLLM's rule)."""
    script = "The sky is blue."
    asked_for = asked(include=["message.output_text.logprobs"], top_logprobs=2)
    whole = respond(server_over(tokenizer, script), asked_for)
    check_with_the_clients_types(whole)
    tokens = tokenizer.encode(script, add_special_tokens=False)
    [part] = whole["output"][0]["content"]
    assert [entry["logprob"] for entry in part["logprobs"]] == [-n / 10 for n in range(1, len(tokens) + 1)]
    assert "".join(entry["token"] for entry in part["logprobs"]) == script
    assert all(len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
               and bytes(entry["bytes"]).decode() == entry["token"] for entry in part["logprobs"])
    assert whole["top_logprobs"] == 2
    events = respond(server_over(tokenizer, script), {**asked_for, "stream": True})
    check_with_the_clients_types(events)
    carried = [entry for event in events if event["type"] == "response.output_text.delta" for entry in event["logprobs"]]
    [done] = [event for event in events if event["type"] == "response.output_text.done"]
    assert carried == done["logprobs"] == events[-1]["response"]["output"][0]["content"][0]["logprobs"] == \
        part["logprobs"]
    # a call after the text: the whole answer's message has its tokens' too, the stream's the text's
    called = "Let me look." + WEATHER_CALL
    whole = respond(server_over(tokenizer, called, "hermes"), asked(tools=TOOLS, **asked_for))
    every = len(tokenizer.encode(called, add_special_tokens=False))
    assert len(whole["output"][0]["content"][0]["logprobs"]) == every
    events = respond(server_over(tokenizer, called, "hermes"), asked(tools=TOOLS, stream=True, **asked_for))
    check_with_the_clients_types(events)
    carried = [entry for event in events if event["type"] == "response.output_text.delta" for entry in event["logprobs"]]
    [done] = [event for event in events if event["type"] == "response.output_text.done"]
    final = events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    # (the tokens the reader held back as a possible tag's start came before the text's last delta)
    assert "".join(entry["token"] for entry in carried).startswith("Let me look.") and len(carried) < every
    assert final == done["logprobs"] == carried
    # a thinking model's stream: the answer's tokens alone, each delta's spelling its text
    thought = "The sky scatters blue light.</think>Blue."
    events = respond(server_over(tokenizer, thought, reasoning_parser="deepseek_r1"), {**asked_for, "stream": True})
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert all("".join(entry["token"] for entry in event["logprobs"]) == event["delta"] for event in deltas)
    whole = respond(server_over(tokenizer, thought, reasoning_parser="deepseek_r1"), asked_for)
    assert len(whole["output"][1]["content"][0]["logprobs"]) == len(tokenizer.encode(thought, add_special_tokens=False))
    plain = respond(server_over(tokenizer, script), asked(top_logprobs=3))
    assert plain["output"][0]["content"][0]["logprobs"] == [] and plain["top_logprobs"] == 3
