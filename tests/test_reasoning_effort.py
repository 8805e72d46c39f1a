"""A chat's reasoning_effort (OpenAI's field, as vLLM 0.32 takes it): the chat template's
reasoning_effort variable and its enable_thinking (false for "none"), unless the request's own
chat_template_kwargs set that; a server default overridden; qwen3's thinking switched by it; a bad
value refused naming the field; the rendered prompt through the route."""

from __future__ import annotations

import pytest

from launcher.serving import openai_protocol as proto

MODEL = "smollm2-135m-instruct"


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def parsed(body: dict, reasoning_parser: str | None = None, defaults: dict | None = None):
    return proto.parse_request(proto.ChatCompletionRequest, body, None, reasoning_parser, defaults)


def test_the_effort_sets_the_templates_variables_as_vllm_sets_them():
    assert parsed(chat(reasoning_effort="low")).chat_template_kwargs == {"reasoning_effort": "low",
                                                                          "enable_thinking": True}
    assert parsed(chat(reasoning_effort="none")).chat_template_kwargs == {"reasoning_effort": "none",
                                                                           "enable_thinking": False}
    assert parsed(chat()).chat_template_kwargs is None and parsed(chat(reasoning_effort=None)).reasoning_effort is None
    # the request's own enable_thinking stays; its own reasoning_effort entry yields to the field
    own = parsed(chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "x"}))
    assert own.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "none"}
    # a server default is overridden: the request asked for this effort
    assert parsed(chat(reasoning_effort="high"), defaults={"enable_thinking": False, "a": 1}).chat_template_kwargs == {
        "enable_thinking": True, "a": 1, "reasoning_effort": "high"}


def test_qwen3s_thinking_follows_the_effort():
    assert parsed(chat(reasoning_effort="none"), "qwen3").reasoning() == ("qwen3", False)
    assert parsed(chat(reasoning_effort="medium"), "qwen3").reasoning() == ("qwen3", True)


@pytest.mark.parametrize("value", ["extreme", 3, True, ""])
def test_a_bad_effort_is_refused_naming_the_field_and_the_values(value):
    with pytest.raises(proto.ProtocolError) as refused:
        parsed(chat(reasoning_effort=value))
    assert refused.value.status == 400 and refused.value.param == "reasoning_effort"
    assert "none, minimal, low, medium, high, xhigh, max" in refused.value.message


def recording_server(smollm2_tokenizer):
    """(a chat server over SmolLM2's tokenizer whose template prints the two variables, the prompts
    its engine was given, as token ids)."""
    import copy

    from tests.test_reasoning_usage import server_over

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "[{{ reasoning_effort | default('unset') }} {{ enable_thinking | default('unset') }}]")
    seen = []
    server = server_over(tokenizer, None, ["ok"])
    astream = server.launcher.astream

    def recording(prompt, sampling, **options):
        seen.append(list(prompt))
        return astream(prompt, sampling, **options)

    server.launcher.astream = recording
    return server, seen


def test_the_template_renders_the_effort(smollm2_tokenizer):
    from tests.test_reasoning_usage import answer

    server, seen = recording_server(smollm2_tokenizer)
    answer(server, chat(reasoning_effort="minimal"))
    assert [server.tokenizer.decode(prompt) for prompt in seen] == ["Hi[minimal True]"]


def test_tokenize_counts_the_chat_with_its_effort_as_the_chat_route_renders_it(smollm2_tokenizer):
    """/tokenize's chat form takes reasoning_effort too (it was a 400): its count is the chat route's
    prompt, the template's variables set alike."""
    import asyncio
    import json

    from tests.test_reasoning_usage import answer
    from tests.test_tokenize_routes import post

    server, seen = recording_server(smollm2_tokenizer)
    answer(server, chat(reasoning_effort="none"))
    counted = asyncio.run(server.tokenize(post("/tokenize", chat(reasoning_effort="none"))))
    plain = asyncio.run(server.tokenize(post("/tokenize", chat())))
    assert json.loads(counted.body)["tokens"] == seen[0] and json.loads(counted.body)["count"] != json.loads(
        plain.body)["count"]
