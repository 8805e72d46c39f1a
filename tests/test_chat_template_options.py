"""How a chat request's messages are rendered (vLLM's extensions of /v1/chat/completions, also taken
by /tokenize's chat form): chat_template_kwargs, the template's extra variables (Qwen3's
enable_thinking, say), refused where they name apply_chat_template's own arguments or hold a control
token in a key; add_generation_prompt and continue_final_message (an assistant's answer begun by the
client and continued by the model). Checked on the rendered prompt, against the tokenizer's own
apply_chat_template, and end to end over an in-process Launcher (the prompt's usage count)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
from tests.model_factory import random_model_with_smollm2_tokenizer

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name a colour."}]
BEGUN = [*CHAT, {"role": "assistant", "content": "The colour is"}]
THINKING_TEMPLATE = (  # a template with an extra variable, as Qwen3's enable_thinking
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if note %}{{ note }}{% endif %}{% endif %}")


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": MODEL, "messages": CHAT, **fields})


@pytest.mark.parametrize("fields, param, words", [
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize", "the server tokenizes"),
    ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs.chat_template", "model's own template"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     "request's own add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "request's tools"),
    ({"chat_template_kwargs": {"return_tensors": "pt"}}, "chat_template_kwargs.return_tensors", "server sets it"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs.self", "renderer's own argument"),
    ({"chat_template_kwargs": {"conversations": []}}, "chat_template_kwargs.conversations", "request's messages"),
    ({"chat_template_kwargs": {"x": json.loads("[" * 128 + "]" * 128)}}, "chat_template_kwargs",
     "nests more than 128 levels"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "an object of extra variables"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "an object of extra variables"),
    ({"chat_template_kwargs": {"note": "\ud800"}}, "chat_template_kwargs", "UTF-8"),
    ({"continue_final_message": True}, "continue_final_message", "send add_generation_prompt: false with it"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "true or false"),
])
def test_bad_rendering_options_are_refused_naming_the_field(fields, param, words):
    for route_model, body in ((ChatCompletionRequest, {"model": MODEL, "messages": CHAT, **fields}),
                              (proto.TokenizeRequest, {"model": MODEL, "messages": CHAT, **fields})):
        with pytest.raises(ProtocolError) as refused:
            parse_request(route_model, body)
        assert refused.value.param == param and words in refused.value.message, refused.value.message


def test_the_options_reach_the_template_as_the_tokenizer_renders_them(smollm2_tokenizer):
    from tests.test_tokenize_routes import answer, replica

    thinking = copy.deepcopy(smollm2_tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    server = replica(thinking)

    def prompt(**fields) -> str:
        request = chat(**fields)
        ids = server._apply_chat_template(request.chat_messages(thinking.chat_template), request.add_generation_prompt,
                                          request.continue_final_message, False, True, None,
                                          request.chat_template_kwargs)
        tokenized = answer(server, "/tokenize", {"model": MODEL, "messages": request.model_dump()["messages"],
                                                 **{k: v for k, v in fields.items() if k != "messages"}})
        assert tokenized["tokens"] == ids  # /tokenize's chat form counts what the chat route renders
        return thinking.decode(ids)

    plain = prompt()
    assert plain.endswith("<|im_start|>assistant\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")
    assert prompt(chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt(chat_template_kwargs={"unused": [1, {"x": None}]}) == plain  # a name the template never reads
    assert prompt(chat_template_kwargs={"note": "Be brief."}).endswith("assistant\nBe brief.")
    # a control token in a value is text; in a key it would be the token itself: refused
    assert prompt(chat_template_kwargs={"note": "<|im_end|>"}).endswith("assistant\n<|im_end|>")
    ids = server._apply_chat_template(chat().chat_messages(), True, False, False, True, None, {"note": "<|im_end|>"})
    assert thinking.convert_tokens_to_ids("<|im_end|>") not in ids[-3:]  # written as text, not the token
    with pytest.raises(ProtocolError) as refused:
        prompt(chat_template_kwargs={"note": {"<|im_start|>system": 1}})
    assert refused.value.param == "chat_template_kwargs.note" and "rename the key" in refused.value.message
    # inside a list or object a template may print the value whole (its repr loses the marks): refused
    for value, where in (([{"x": "<|im_end|>"}], "chat_template_kwargs.note.0.x"),
                         ({"k": ["ok", "\U000F0000"]}, "chat_template_kwargs.note.k.1")):
        with pytest.raises(ProtocolError) as refused:
            prompt(chat_template_kwargs={"note": value})
        assert refused.value.param == where and "inside a list or object" in refused.value.message
    assert prompt(chat_template_kwargs={"note": ["a", {"b": 2}]}).endswith("assistant\n['a', {'b': 2}]")
    assert prompt(chat_template_kwargs={"note": "x" * 3, "deep": json.loads("[" * 127 + "]" * 127)}).endswith("xxx")
    # an assistant's answer begun by the client and left open: no end of turn, no new assistant turn
    begun = prompt(messages=BEGUN, add_generation_prompt=False, continue_final_message=True)
    assert begun.endswith("<|im_start|>assistant\nThe colour is")
    assert begun == thinking.decode(thinking.apply_chat_template(BEGUN, continue_final_message=True, return_dict=False))
    assert prompt(messages=BEGUN, add_generation_prompt=False).endswith("The colour is<|im_end|>\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("template_options"))


def test_chat_completions_render_with_the_requests_options(model_dir, in_process_cluster):
    """Over a real in-process Launcher: the prompt the engine gets (its usage count) is the one the
    options render, whole and streamed; the default is as before."""
    from launcher.api import Launcher
    from tests.test_skip_special_tokens import answered, replica_over

    route = "/v1/chat/completions"
    asked = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0}
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, progress=False, compile=False) as llm:
        server = replica_over(llm)
        server.tokenizer = copy.deepcopy(llm.tokenizer)
        server.tokenizer.chat_template = THINKING_TEMPLATE
        tokenizer = server.tokenizer

        async def every():
            answers = [await answered(server, route, body) for body in (
                asked, {**asked, "chat_template_kwargs": {"enable_thinking": False}},
                {**asked, "messages": BEGUN, "add_generation_prompt": False, "continue_final_message": True},
                {**asked, "chat_template_kwargs": {"enable_thinking": False}, "stream": True,
                 "stream_options": {"include_usage": True}})]
            server.default_chat_template_kwargs = {"enable_thinking": False}  # as the constructor sets it
            return [*answers, await answered(server, route, asked)]

        plain, unthinking, begun, streamed, defaulted = asyncio.run(every())

    def count(messages, **options) -> int:
        return len(tokenizer.apply_chat_template(messages, return_dict=False, **options))

    assert plain["usage"]["prompt_tokens"] == count(CHAT, add_generation_prompt=True)
    assert unthinking["usage"]["prompt_tokens"] == count(CHAT, add_generation_prompt=True, enable_thinking=False)
    assert unthinking["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert begun["usage"]["prompt_tokens"] == count(BEGUN, continue_final_message=True)
    assert streamed[-1]["usage"]["prompt_tokens"] == unthinking["usage"]["prompt_tokens"]
    assert defaulted["usage"]["prompt_tokens"] == unthinking["usage"]["prompt_tokens"]  # the server's default


REASONING_TEMPLATE = (  # renders an assistant's thinking, as Qwen3's template does for the last turn
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_assistants_reasoning_sent_back_reaches_the_template(smollm2_tokenizer):
    """vLLM's `reasoning` (and its older name `reasoning_content`) on an assistant message, as a server
    with a reasoning parser returns it: handed to the template under both names."""
    from tests.test_tokenize_routes import replica

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = REASONING_TEMPLATE
    server = replica(tokenizer)

    def rendered(assistant: dict) -> str:
        request = chat(messages=[*CHAT, {"role": "assistant", "content": "Blue.", **assistant}, CHAT[0]])
        return tokenizer.decode(server._apply_chat_template(request.chat_messages(tokenizer.chat_template)))

    assert "assistant\n<think>A sky colour.</think>Blue." in rendered({"reasoning": "A sky colour."})
    assert "assistant\n<think>Old name.</think>Blue." in rendered({"reasoning_content": "Old name."})
    assert "<think>New.</think>" in rendered({"reasoning": "New.", "reasoning_content": "Old."})  # vLLM's rule
    assert "<think>" not in rendered({"reasoning": None})
    for message, param in (({"role": "user", "content": "x", "reasoning": "r"}, "messages.0.reasoning"),
                           ({"role": "assistant", "content": "x", "reasoning": "\ud800"}, "messages.0.reasoning")):
        with pytest.raises(ProtocolError) as refused:
            chat(messages=[message])
        assert refused.value.param == param


def test_the_servers_default_template_variables_sit_under_the_requests_own():
    """--default-chat-template-kwargs (builder argument default_chat_template_kwargs): every chat
    request, and /tokenize's chat form, gets them unless it sends its own value (vLLM's merge); bad
    defaults are refused before anything starts, naming the option."""
    from launcher.cli import build_parser
    from launcher.cli.serve_command import server_args
    from launcher.serving.server_settings import SERVER_ARGS, settings_from_args

    defaults = {"enable_thinking": False, "note": "Be brief."}
    merged = parse_request(ChatCompletionRequest, {"model": MODEL, "messages": CHAT,
                                                   "chat_template_kwargs": {"note": "Mine."}}, None, "qwen3", defaults)
    assert merged.chat_template_kwargs == {"enable_thinking": False, "note": "Mine."}
    assert merged.reasoning() == ("qwen3", False)  # the default turns Qwen3's thinking off
    assert parse_request(ChatCompletionRequest, {"model": MODEL, "messages": CHAT, "chat_template_kwargs": {
        "enable_thinking": True}}, None, "qwen3", defaults).reasoning() == ("qwen3", True)
    assert parse_request(proto.TokenizeRequest, {"model": MODEL, "messages": CHAT}, None, None,
                         defaults).chat_template_kwargs == defaults
    assert parse_request(ChatCompletionRequest, {"model": MODEL, "messages": CHAT}).chat_template_kwargs is None
    # from `serve run` text, a YAML config's mapping, and the command line
    assert settings_from_args({"default_chat_template_kwargs": '{"enable_thinking": false}'}) \
        .default_chat_template_kwargs == {"enable_thinking": False}
    assert settings_from_args({"default_chat_template_kwargs": defaults}).default_chat_template_kwargs == defaults
    flags = {k: "--" + k.replace("_", "-") for k in SERVER_ARGS}
    serve = lambda *argv: settings_from_args(server_args(build_parser().parse_args(["serve", *argv])), flags)
    assert serve("--default-chat-template-kwargs", '{"enable_thinking": false}').default_chat_template_kwargs == {
        "enable_thinking": False}
    assert serve().default_chat_template_kwargs is None
    for bad, words in (('[1]', "must be a JSON object"), ('{"tokenize": true}', "apply_chat_template's own arguments"),
                       ('{"a": "\\ud800"}', "valid UTF-8 text")):
        with pytest.raises(ValueError, match=rf"--default-chat-template-kwargs.*{words}"):
            settings_from_args({"default_chat_template_kwargs": json.loads(bad)}, flags)
    for bad in ("{nope", "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--default-chat-template-kwargs", bad])


def test_a_template_refusing_the_marked_text_is_a_400_not_a_500(smollm2_tokenizer):
    """Sanitizing marks control tokens in the text the second render sees (two code points each), so
    a template that checks a length can refuse only that render: a 400 naming messages, as the first."""
    from tests.test_tokenize_routes import replica

    strict = copy.deepcopy(smollm2_tokenizer)
    strict.chat_template = ("{% if note|length > 12 %}{{ raise_exception('too long') }}{% endif %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}")
    server = replica(strict)
    with pytest.raises(ProtocolError) as refused:
        server._apply_chat_template(chat().chat_messages(), True, False, False, True, None, {"note": "<|im_end|>12"})
    assert refused.value.param == "messages" and "too long" in refused.value.message


def test_server_defaults_too_deep_are_refused_at_start():
    from launcher.serving.server_settings import settings_from_args

    with pytest.raises(ValueError, match="default_chat_template_kwargs nests more than 128 levels"):
        settings_from_args({"default_chat_template_kwargs": {"x": json.loads("[" * 200 + "]" * 200)}})
