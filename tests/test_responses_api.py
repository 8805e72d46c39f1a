"""/v1/responses' translation (launcher/serving/responses/), with no server: Responses requests
become chat bodies the chat parser takes (each input item kind, instructions, tools, tool_choice, text
formats, reasoning), every refusal names the Responses field and its fix, chat-parser refusals are
named back in the Responses request's terms, and the answer (whole or streamed) comes out as objects
and events the official openai client's own pydantic models accept and its stream accumulator
rebuilds into the same response."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from launcher.serving import openai_protocol as proto
from launcher.serving import responses as api
from launcher.serving.responses import ResponseEvents, chat_body, output_items, responses_param

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_USAGE = proto.usage(12, 7, cached_tokens=4, reasoning_tokens=3)


def chat_of(body: dict) -> dict:
    """The chat body of a Responses body (with a model), checked by the chat parser as the app does."""
    chat, _ = chat_body({"model": "m", **body})
    proto.parse_request(proto.ChatCompletionRequest, chat, tool_call_parser="hermes")
    return chat


def refusal(body: dict) -> proto.ProtocolError:
    with pytest.raises(proto.ProtocolError) as caught:
        chat_body({"model": "m", **body})
    assert caught.value.status == 400
    return caught.value


def chat_refusal(body: dict) -> tuple[proto.ProtocolError, api.ResponsesEcho]:
    """The chat parser's refusal of a Responses body that chat_body itself lets through."""
    chat, echo = chat_body({"model": "m", **body})
    with pytest.raises(proto.ProtocolError) as caught:
        proto.parse_request(proto.ChatCompletionRequest, chat)
    return caught.value, echo


# ---- the request ------------------------------------------------------------------------------
def test_a_string_input_is_one_user_message_and_instructions_a_first_system_message():
    chat = chat_of({"input": "Hello", "instructions": "Answer in French.", "stream": True})
    assert chat == {"model": "m", "stream": True, "messages": [{"role": "system", "content": "Answer in French."},
                                                                {"role": "user", "content": "Hello"}]}


def test_empty_instructions_add_no_system_message_and_are_echoed():
    chat, echo = chat_body({"model": "m", "input": "hi", "instructions": ""})
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert echo.instructions == ""


@pytest.mark.parametrize("role", ["user", "system", "developer", "assistant"])
def test_message_items_of_each_role_with_string_or_text_parts(role):
    parts = [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"},
             {"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]
    chat = chat_of({"input": [{"role": role, "content": "plain"}, {"type": "message", "role": role, "content": parts},
                              {"role": "user", "content": "end"}]})
    assert chat["messages"][:2] == [{"role": role, "content": "plain"},
                                    {"role": role, "content": [{"type": "text", "text": t} for t in "abc"]}]


def test_an_output_message_fed_back_keeps_its_text_and_drops_its_id_and_status():
    fed_back = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi!", "annotations": [], "logprobs": []}]}
    chat = chat_of({"input": [{"role": "user", "content": "hi"}, fed_back, {"role": "user", "content": "again"}]})
    assert chat["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]}


def call_item(call_id: str, arguments: str = '{"city": "Paris"}') -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}


def test_consecutive_function_calls_join_one_assistant_message_and_outputs_are_tool_messages():
    chat = chat_of({"tools": [TOOL], "input": [
        {"role": "user", "content": "weather?"}, call_item("c1"), call_item("c2", '{"city": "Rome"}'),
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"},
                                                                     {"type": "input_text", "text": "y"}]}]})
    assert chat["messages"][1:] == [
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain\ny"}]  # parts joined as chat joins them


def test_a_whole_earlier_output_fed_back_is_one_assistant_turn():
    """reasoning, message and calls, as output_items gives them: the chat turn holds all three."""
    earlier, _, _ = output_items({"role": "assistant", "reasoning": "think", "content": "Let me look.",
                                  "tool_calls": [{"id": "c1", "type": "function", "function": {
                                      "name": "get_weather", "arguments": "{}"}}]}, "tool_calls")
    chat = chat_of({"tools": [TOOL], "input": [{"role": "user", "content": "weather?"}, *earlier,
                                               {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    assert chat["messages"][1] == {"role": "assistant", "reasoning": "think",
                                   "content": [{"type": "text", "text": "Let me look."}],
                                   "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert len(chat["messages"]) == 3


def test_reasoning_goes_to_the_next_assistant_message_and_is_dropped_before_a_user_message():
    chat = chat_of({"input": [
        {"role": "user", "content": "q1"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "dropped"}]},
        {"role": "user", "content": "q2"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "summary only"}]},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"}]})
    assert chat["messages"] == [{"role": "user", "content": "q1"}, {"role": "user", "content": "q2"},
                                {"role": "assistant", "content": "a2", "reasoning": "summary only"},
                                {"role": "user", "content": "q3"}]


def test_tools_and_each_tool_choice_form():
    chat = chat_of({"input": "hi", "tools": [{**TOOL, "strict": True}], "tool_choice": "required"})
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city", "parameters": TOOL["parameters"],
        "strict": True}}]
    assert chat["tool_choice"] == "required"
    named = chat_of({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_of({"input": "hi", "tools": [TOOL], "tool_choice": "auto"})["tool_choice"] == "auto"
    assert chat_of({"input": "hi", "tools": [TOOL], "tool_choice": "none"})["tool_choice"] == "none"


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_or_none_without_tools_is_not_handed_on_and_is_echoed(choice):
    chat, echo = chat_body({"model": "m", "input": "hi", "tools": [], "tool_choice": choice})
    assert "tools" not in chat and "tool_choice" not in chat
    assert (echo.tools, echo.tool_choice) == ([], choice)


@pytest.mark.parametrize("text, response_format", [
    ({"format": {"type": "text"}}, None),
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True,
                 "description": "d"}},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True,
                                             "description": "d"}}),
    ({"verbosity": "medium"}, None),
])
def test_text_formats(text, response_format):
    chat = chat_of({"input": "hi", "text": text})
    assert chat.get("response_format") == response_format


def test_sampling_fields_and_max_output_tokens_go_to_the_chat_and_are_echoed():
    sent = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"7": 1.0}, "parallel_tool_calls": False,
            "skip_special_tokens": False, "include_stop_str_in_output": True}
    chat, echo = chat_body({"model": "m", "input": "hi", "max_output_tokens": 32, "top_k": None, **sent})
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 32, **sent}
    assert (echo.temperature, echo.top_p, echo.parallel_tool_calls, echo.max_output_tokens) == (0.5, 0.9, False, 32)
    proto.parse_request(proto.ChatCompletionRequest, chat)


def test_reasoning_effort_goes_to_the_template_as_vllm_hands_it():
    chat, echo = chat_body({"model": "m", "input": "hi", "reasoning": {"effort": "none", "summary": "auto"}})
    assert chat["reasoning_effort"] == "none" and echo.reasoning == {"effort": "none", "summary": "auto"}
    parsed = proto.parse_request(proto.ChatCompletionRequest, chat)
    assert parsed.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    chat, _ = chat_body({"model": "m", "input": "hi", "reasoning": {"effort": "high"}})
    assert proto.parse_request(proto.ChatCompletionRequest, chat).chat_template_kwargs == {
        "reasoning_effort": "high", "enable_thinking": True}
    assert "reasoning_effort" not in chat_body({"model": "m", "input": "hi", "reasoning": {}})[0]


def test_fields_that_ask_for_nothing_are_taken_and_echoed():
    chat, echo = chat_body({"model": "m", "input": "hi", "store": True, "metadata": {"k": "v"}, "user": "u",
                            "service_tier": "flex", "prompt_cache_key": "p", "safety_identifier": "s",
                            "truncation": "disabled", "include": ["reasoning.encrypted_content"], "top_logprobs": 0,
                            "max_tool_calls": None, "background": False, "previous_response_id": None,
                            "stream_options": {"include_obfuscation": False}})
    assert set(chat) == {"model", "messages"}
    assert (echo.store, echo.metadata, echo.user, echo.service_tier, echo.prompt_cache_key,
            echo.safety_identifier) == (False, {"k": "v"}, "u", "default", "p", "s")


@pytest.mark.parametrize("body, param, words", [
    ("not an object", None, ["JSON object", "a string"]),
    ({"inputs": "hi"}, "inputs", ["'input'"]),
    ({"input": "hi", "messages": []}, "messages", ["send the conversation as input"]),
    ({"input": "hi", "max_tokens": 5}, "max_tokens", ["max_output_tokens"]),
    ({}, "input", ["input is required"]),
    ({"input": []}, "input", ["empty list"]),
    ({"input": 5}, "input", ["5", "a string or a list"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", ["'input_image'", "text only", "input_text"]),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_file", "file_id": "f"}]}]},
     "input[1].content[1].type", ["'input_file'", "text only"]),
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "input[0].content[0].type", ["'refusal'", "input_text"]),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input[0].content[0].text", ["3", "a string"]),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type",
     ["'web_search_call'", "message, function_call, function_call_output, reasoning"]),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", ["'item_reference'"]),
    ({"input": [{"content": "no role"}]}, "input[0].type", ["no type"]),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", ["'tool'", "function_call_output"]),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name", ["'name'"]),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments",
     ["is required", "a string"]),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0].type", ["'input_image'", "text only"]),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "xyz"}]}, "input[0].encrypted_content",
     ["encrypted", "reasoning_text"]),
    ({"input": "hi", "instructions": 7}, "instructions", ["7", "a string"]),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type",
     ["'web_search'", "only function tools", "no built-in tools"]),
    ({"input": "hi", "tools": [TOOL, {"type": "mcp", "server_label": "x"}]}, "tools[1].type", ["'mcp'"]),
    ({"input": "hi", "tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading", ["'defer_loading'"]),
    ({"input": "hi", "tools": {"type": "function"}}, "tools", ["a list of function tools"]),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice.type", ["allowed_tools", "send only the allowed functions as tools"]),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice.type",
     ["'file_search'", "no built-in tools"]),
    ({"input": "hi", "tools": [TOOL], "tool_choice": "any"}, "tool_choice", ["'any'", "\"required\""]),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type", ["'grammar'", "json_schema"]),
    ({"input": "hi", "text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema",
     ["'schema'"]),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity", ["'low'", "leave it out"]),
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort", ["'max'", "minimal"]),
    ({"input": "hi", "top_logprobs": -1}, "top_logprobs", ["-1", "from 0 to 20"]),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs", ["21", "from 0 to 20"]),
    ({"input": "hi", "store": "yes"}, "store", ["'yes'"]),
    # 0 == False in Python: a 0 was let through, and the response was kept
    ({"input": "hi", "store": 0}, "store", ["store (0) must be true or false"]),
    ({"input": "hi", "store": 1.0}, "store", ["store (1.0) must be true or false"]),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id",
     ["'resp_1'", "send the earlier turns", "input"]),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", ["'conv_1'", "input"]),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", ["pmpt_1", "instructions"]),
    ({"input": "hi", "background": True}, "background", ["true", "stream"]),
    ({"input": "hi", "background": 0}, "background", ["background (0) is not supported", "(or false)"]),
    ({"input": "hi", "include": "message.output_text.logprobs"}, "include", ["must be a list of strings"]),
    ({"input": "hi", "include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include[1]",
     ["file_search_call.results", "built-in tools", '"message.output_text.logprobs" and']),
    ({"input": "hi", "truncation": "auto"}, "truncation", ["'auto'", "never truncates", "shorter"]),
    ({"input": "hi", "max_tool_calls": 2}, "max_tool_calls", ["2", "leave it out"]),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", ["17", "at most 16"]),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k", ["1", "a string"]),
    ({"input": "hi", "service_tier": "gold"}, "service_tier", ["'gold'"]),
    ({"input": "hi", "stream_options": {"include_usage": True}}, "stream_options", ["include_obfuscation"]),
    ({"input": "hi", "stream_options": {"include_obfuscation": 0}}, "stream_options", ["true or false"]),
])
def test_every_refusal_names_the_responses_field_the_value_and_the_fix(body, param, words):
    if isinstance(body, dict):
        err = refusal(body)
    else:
        with pytest.raises(proto.ProtocolError) as caught:
            chat_body(body)
        err = caught.value
    assert err.status == 400 and err.param == param
    for word in words:
        assert word in err.message, (word, err.message)


# ---- chat refusals named back ---------------------------------------------------------------------
@pytest.mark.parametrize("chat_param, expected", [
    (None, None), ("temperature", "temperature"), ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"), ("response_format.type", "text.format.type"),
    ("response_format.json_schema", "text.format"), ("response_format.json_schema.name", "text.format.name"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("tools", "tools"), ("tools.2", "tools[2]"), ("tools.2.type", "tools[2].type"),
    ("tools.0.function", "tools[0]"), ("tools.3.function.name", "tools[3].name"),
    ("tools.1.function.parameters", "tools[1].parameters"), ("tool_choice", "tool_choice"),
    ("tool_choice.function.name", "tool_choice.name"), ("tool_choice.type", "tool_choice.type"),
    ("reasoning_effort", "reasoning.effort"),
])
def test_chat_params_are_named_as_the_responses_request_names_them(chat_param, expected):
    assert responses_param(chat_param) == expected


def test_message_params_name_the_input_item_after_instructions_and_joined_calls():
    _, echo = chat_body({"model": "m", "instructions": "sys", "tools": [TOOL], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},                   # messages.1
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},  # input[1]
        call_item("c1"), call_item("c2"),                                                      # messages.2
        {"type": "function_call_output", "call_id": "c1", "output": "x"},                       # messages.3
        {"type": "function_call_output", "call_id": "c2", "output": "y"},                       # messages.4
        {"role": "user", "content": "again"}]})                                                # messages.5
    assert [responses_param(p, echo) for p in (
        "messages.0.content", "messages.1.content.0.text", "messages.1.content", "messages.1",
        "messages.2.tool_calls.0.function.arguments", "messages.2.tool_calls.1.function.name",
        "messages.2.tool_calls.1.id", "messages.2.tool_calls.1", "messages.2.reasoning", "messages.3.content",
        "messages.4.tool_call_id", "messages.5.content", "messages.5.role", "messages.9.content")] == [
        "instructions", "input[0].content[0].text", "input[0].content", "input[0]",
        "input[2].arguments", "input[3].name", "input[3].call_id", "input[3]", "input[1].content",
        "input[4].output", "input[5].call_id", "input[6].content", "input[6].role", "input"]
    assert responses_param("messages.0.content") == "input"  # no echo: only the whole input is certain


def test_a_real_chat_refusal_names_the_input_item_it_came_from():
    err, echo = chat_refusal({"instructions": "be brief", "input": [
        {"role": "user", "content": "a"}, {"role": "user", "content": []}]})
    assert (err.param, responses_param(err.param, echo)) == ("messages.2.content", "input[1].content")
    err, echo = chat_refusal({"input": "hi", "max_output_tokens": 0})
    assert responses_param(err.param, echo) == "max_output_tokens"
    err, echo = chat_refusal({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}],
                              "tool_choice": "required"})
    assert responses_param(err.param, echo) == "tools[0].name"
    err, echo = chat_refusal({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}})
    assert responses_param(err.param, echo) == "text.format.name"


# ---- the whole answer ---------------------------------------------------------------------------
def whole_response(items, status, reason, echo=None) -> dict:
    obj = api.response_object("resp_1", 1700000000, "m", echo or chat_body({"input": "hi"})[1], items, status,
                              api.usage(CHAT_USAGE), reason)
    Response.model_validate(obj)
    return obj


def test_usage_in_the_responses_form():
    assert api.usage(CHAT_USAGE) == {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4,
                                                                                   "cache_write_tokens": 0},
                                     "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3},
                                     "total_tokens": 19}
    assert api.usage(proto.usage(5, 2))["output_tokens_details"] == {"reasoning_tokens": 0}


def test_the_clients_response_model_is_a_real_check():
    obj = whole_response(*output_items({"role": "assistant", "content": "x"}, "stop"))
    broken = {**obj, "usage": {**obj["usage"], "input_tokens_details": {"cached_tokens": 0}}}
    with pytest.raises(ValidationError):
        Response.model_validate(broken)


def test_content_is_one_message_item():
    items, status, reason = output_items({"role": "assistant", "content": "Hi there"}, "stop")
    assert (status, reason) == ("completed", None)
    assert [{**item, "id": item["id"][:4]} for item in items] == [
        {"type": "message", "id": "msg_", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}]}]
    obj = whole_response(items, status, reason)
    assert Response.model_validate(obj).output_text == "Hi there"
    assert obj["store"] is False and obj["incomplete_details"] is None and obj["completed_at"] is not None


def test_reasoning_content_and_calls_in_order():
    message = {"role": "assistant", "reasoning": "let me think", "content": "Checking.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "A"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "B"}'}}]}
    items, status, _ = output_items(message, "tool_calls")
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "let me think"}] and items[0]["summary"] == []
    assert [(i["call_id"], i["name"], i["arguments"], i["status"]) for i in items[2:]] == [
        ("call_a", "get_weather", '{"city": "A"}', "completed"),
        ("call_b", "get_weather", '{"city": "B"}', "completed")]
    assert items[0]["id"].startswith("rs_") and items[2]["id"].startswith("fc_")
    assert len({item["id"] for item in items}) == 4 and status == "completed"
    whole_response(items, status, None)


def test_calls_alone_make_no_message_and_an_empty_answer_one_empty_message():
    items, _, _ = output_items({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls")
    assert [item["type"] for item in items] == ["function_call"]
    items, _, _ = output_items({"role": "assistant", "content": ""}, "stop")
    assert [(item["type"], item["content"][0]["text"]) for item in items] == [("message", "")]


def test_a_length_finish_is_incomplete_and_so_is_its_last_item():
    items, status, reason = output_items({"role": "assistant", "reasoning": "hmm", "content": "The ans"}, "length")
    assert (status, reason) == ("incomplete", "max_output_tokens")
    assert [item["status"] for item in items] == ["completed", "incomplete"]
    obj = whole_response(items, status, reason)
    assert obj["incomplete_details"] == {"reason": "max_output_tokens"} and obj["completed_at"] is None
    items, _, _ = output_items({"role": "assistant", "reasoning": "cut while thinking", "content": None}, "length")
    assert [(item["type"], item["status"]) for item in items] == [("reasoning", "incomplete")]


def test_the_response_echoes_the_request():
    body = {"model": "m", "input": "hi", "instructions": "sys", "tools": [TOOL], "tool_choice": "required",
            "temperature": 0.2, "max_output_tokens": 50, "text": {"format": {"type": "json_schema", "name": "x",
                                                                             "schema": {"type": "object"}}},
            "metadata": {"a": "b"}, "reasoning": {"effort": "low"}, "user": "u", "parallel_tool_calls": False}
    _, echo = chat_body(body)
    obj = whole_response(*output_items({"role": "assistant", "content": "{}"}, "stop"), echo=echo)
    assert {key: obj[key] for key in ("instructions", "tools", "tool_choice", "temperature", "top_p",
                                      "max_output_tokens", "text", "metadata", "reasoning", "user",
                                      "parallel_tool_calls", "store", "truncation", "background",
                                      "previous_response_id", "top_logprobs", "service_tier")} == {
        "instructions": "sys", "tools": [TOOL], "tool_choice": "required", "temperature": 0.2, "top_p": 1.0,
        "max_output_tokens": 50, "text": body["text"], "metadata": {"a": "b"},
        "reasoning": {"effort": "low", "summary": None}, "user": "u", "parallel_tool_calls": False,
        "store": False, "truncation": "disabled", "background": False, "previous_response_id": None,
        "top_logprobs": 0, "service_tier": "default"}
    defaults = whole_response([], "completed", None)
    assert (defaults["tool_choice"], defaults["tools"], defaults["text"], defaults["metadata"]) == (
        "auto", [], {"format": {"type": "text"}}, {})


# ---- the stream -------------------------------------------------------------------------------
def stream(deltas: list[dict], finish: str | None, echo=None) -> list[dict]:
    """Every event of a stream of these chat deltas, each checked by the client's event union and
    fed to its stream accumulator; the accumulated final response must equal the sent one."""
    events = ResponseEvents("resp_1", 1700000000, "m", echo or chat_body({"input": "hi"})[1])
    sent = events.opening()
    for delta in deltas:
        sent += events.delta(delta)
    sent += events.finish(finish, api.usage(CHAT_USAGE))
    check_stream(sent)
    return sent


def told_output(done: list[dict]) -> list[dict]:
    """The output the done events tell, in order: a call closed as incomplete before content (its
    reader turned it back into text) left out, the messages either side of it one message, the
    first's id and the second's status (as the whole answer, all text, has them)."""
    items, dropped = [], False
    for event in done:
        item = event["item"]
        if item is not done[-1]["item"] and item["type"] == "function_call" and item["status"] == "incomplete":
            dropped = True
            continue
        if dropped and items and item["type"] == items[-1]["type"] == "message":
            [first], [then] = items[-1]["content"], item["content"]
            items[-1] = {**items[-1], "status": item["status"], "content": [
                {**first, "text": first["text"] + then["text"], "logprobs": first["logprobs"] + then["logprobs"]}]}
        else:
            items.append(item)
        dropped = False
    return items


def check_stream(sent: list[dict]) -> None:
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in sent:
        parsed = EVENT.validate_python(event)
        assert parsed.type == event["type"]
        state.handle_event(parsed)
    assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
    assert [event["type"] for event in sent[:2]] == ["response.created", "response.in_progress"]
    assert sent[0]["response"]["status"] == "in_progress" and sent[0]["response"]["output"] == []
    final = sent[-1]["response"]
    Response.model_validate(final)
    # each item: added at its output index, its deltas adding up to its done events and its final form
    added = [e for e in sent if e["type"] == "response.output_item.added"]
    done = [e for e in sent if e["type"] == "response.output_item.done"]
    assert told_output(sorted(done, key=lambda e: e["output_index"])) == final["output"]
    assert [e["output_index"] for e in added] == list(range(len(done)))
    assert sorted(e["output_index"] for e in done) == list(range(len(done)))
    for event in added:
        item, index = event["item"], event["output_index"]
        whole = next(e for e in done if e["output_index"] == index)["item"]
        assert (whole["id"], whole["type"]) == (item["id"], item["type"]) and item["status"] == "in_progress"
        mine = [e for e in sent if e.get("item_id") == item["id"]]
        assert all(e["output_index"] == index for e in mine)
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        assert deltas == whole_text(whole)
        texts = [e.get("text", e.get("arguments")) for e in mine if e["type"].endswith(".done")
                 and e["type"] != "response.content_part.done"]
        assert texts == [whole_text(whole)]
    assert state._completed_response is not None or final["status"] != "completed"


def whole_text(item: dict) -> str:
    if item["type"] == "function_call":
        return item["arguments"]
    return "".join(part["text"] for part in item["content"])


def types(sent: list[dict]) -> list[str]:
    return [event["type"] for event in sent]


def test_content_then_two_tool_calls_with_argument_pieces():
    sent = stream([
        {"role": "assistant", "content": ""}, {"content": "Let me "}, {"content": "check."},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time",
                                                                                      "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}], "tool_calls")
    assert types(sent) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",  # each call done before the next is added, as OpenAI's
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = sent[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [
        ("message", "completed"), ("function_call", "completed"), ("function_call", "completed")]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in final["output"][1:]] == [
        ("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "get_time", "{}")]
    arguments_done = [e for e in sent if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in arguments_done] == [("get_weather", '{"city": "Paris"}'),
                                                                    ("get_time", "{}")]
    assert final["usage"] == api.usage(CHAT_USAGE) and final["status"] == "completed"


def test_reasoning_then_content():
    sent = stream([{"reasoning": "Think"}, {"reasoning": "ing."}, {"reasoning": " Done", "content": "Answer"},
                   {"content": " here."}], "stop")
    assert types(sent)[2:9] == ["response.output_item.added", "response.content_part.added",
                                "response.reasoning_text.delta", "response.reasoning_text.delta",
                                "response.reasoning_text.delta", "response.reasoning_text.done",
                                "response.content_part.done"]
    final = sent[-1]["response"]
    assert [whole_text(item) for item in final["output"]] == ["Thinking. Done", "Answer here."]
    assert Response.model_validate(final).output_text == "Answer here."


def test_an_empty_answer_is_one_empty_message_as_in_the_whole_answer():
    sent = stream([{"role": "assistant", "content": ""}], "stop")
    assert types(sent) == ["response.created", "response.in_progress", "response.output_item.added",
                           "response.content_part.added", "response.output_text.done", "response.content_part.done",
                           "response.output_item.done", "response.completed"]
    whole, _, _ = output_items({"role": "assistant", "content": ""}, "stop")
    streamed = sent[-1]["response"]["output"]
    assert [{**item, "id": None} for item in streamed] == [{**item, "id": None} for item in whole]


def test_a_length_finish_ends_with_response_incomplete():
    sent = stream([{"reasoning": "a"}, {"content": "The answer is"}], "length")
    final = sent[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in final["response"]["output"]] == ["completed", "incomplete"]


def test_the_stream_and_the_whole_answer_give_the_same_items():
    deltas = [{"reasoning": "r"}, {"content": "c"},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f",
                                                                                         "arguments": "{}"}}]}]
    streamed = stream(deltas, "tool_calls")[-1]["response"]["output"]
    whole, _, _ = output_items({"role": "assistant", "reasoning": "r", "content": "c", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls")
    assert [{**item, "id": None} for item in streamed] == [{**item, "id": None} for item in whole]


def test_a_failure_sends_an_error_event_then_response_failed():
    events = ResponseEvents("resp_1", 1, "m", chat_body({"input": "hi"})[1])
    sent = events.opening() + events.delta({"content": "partial"})
    sent += events.failed({"message": "generation failed: boom", "type": "server_error", "param": None,
                           "code": None})
    for event in sent:
        EVENT.validate_python(event)
    assert types(sent)[-2:] == ["error", "response.failed"]
    assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
    assert sent[-2]["message"] == "generation failed: boom" and sent[-2]["code"] == "server_error"
    failed = sent[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "generation failed: boom"}
    assert [(item["status"], whole_text(item)) for item in failed["output"]] == [("incomplete", "partial")]


def test_arguments_for_a_call_never_opened_are_a_bug_said_loudly():
    events = ResponseEvents("resp_1", 1, "m", chat_body({"input": "hi"})[1])
    with pytest.raises(ValueError, match="tool call 2"):
        events.delta({"tool_calls": [{"index": 2, "function": {"arguments": "{}"}}]})


def test_sse_framing_names_the_event_and_ends_with_a_blank_line():
    event = {"type": "response.output_text.delta", "sequence_number": 3, "delta": "a\nb"}
    text = api.sse(event)
    head, data, rest = text.split("\n", 2)
    assert head == "event: response.output_text.delta" and rest == "\n"
    assert json.loads(data.removeprefix("data: ")) == event


def test_a_call_cut_short_sends_its_last_piece_before_the_text_it_turned_into():
    """A length cut inside a call: the chat reader's last delta carries the open call's last piece and
    the call's text as content; the piece goes to the call, which is closed as incomplete (it made
    the stream fail: the content closed the call first), and left out of the response, whose text
    is one message, as the whole answer's (the text the call turned into joins the message before
    it; the call had been closed as completed, and was kept for the next turn)."""
    sent = stream([{"content": "Let me look."},
                   {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "weather", "arguments": '{"ci'}}]},
                   {"content": '<tool_call>{"name": "weather", "arguments": {"city',
                    "tool_calls": [{"index": 0, "function": {"arguments": "ty"}}]}], "length")
    final = sent[-1]["response"]
    assert sent[-1]["type"] == "response.incomplete"
    assert [(item["type"], item["status"]) for item in final["output"]] == [("message", "incomplete")]
    assert whole_text(final["output"][0]) == 'Let me look.<tool_call>{"name": "weather", "arguments": {"city'
    [call] = [event["item"] for event in sent if event["type"] == "response.output_item.done"
              and event["item"]["type"] == "function_call"]
    assert call["arguments"] == '{"city' and call["status"] == "incomplete"
