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


def test_the_template_renders_the_effort(smollm2_tokenizer):
    import copy

    from tests.test_reasoning_usage import answer, server_over

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "[{{ reasoning_effort | default('unset') }} {{ enable_thinking | default('unset') }}]")
    seen = []
    server = server_over(tokenizer, None, ["ok"])
    astream = server.launcher.astream

    def recording(prompt, sampling, **options):
        seen.append(tokenizer.decode(prompt))
        return astream(prompt, sampling, **options)

    server.launcher.astream = recording
    answer(server, chat(reasoning_effort="minimal"))
    assert seen == ["Hi[minimal True]"]
