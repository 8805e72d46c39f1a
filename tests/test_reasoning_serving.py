"""--reasoning-parser on /v1/chat/completions (launcher/serving/reasoning.py read by the app): the
option and builder argument, which requests have their thinking split (a structured output's too,
its constraint starting after the thinking's end token), the answer's `reasoning` field whole and streamed through
the route's renderer, the content then read by a tool-call parser, include_reasoning false, and end to
end over a real in-process Launcher."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, ResponseMeta, parse_request
from launcher.serving.openai_render import ChatRender
from launcher.serving.stream_types import StreamDelta
from launcher.serving.token_pieces import TokenPieces
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.call_reader_checks import reassembled
from tests.test_tool_calls import BASE, TOOLS

THOUGHT_AND_CALL = ('<think>\nThe user wants Paris.\n</think>\n\nLet me check.'
                    '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>')


def chat(reasoning_parser: str | None, tool_call_parser: str | None = None, **fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {**BASE, **fields}, tool_call_parser, reasoning_parser)


def test_the_reasoning_parser_option_and_builder_argument():
    from launcher.cli import build_parser
    from launcher.cli.serve_command import server_args
    from launcher.serving.server_settings import SERVER_ARGS, settings_from_args

    assert settings_from_args({}).reasoning_parser is None
    assert settings_from_args({"reasoning_parser": "qwen3"}).reasoning_parser == "qwen3"
    assert settings_from_args({"reasoning_parser": "null"}).reasoning_parser is None
    for bad in ("qwen2", ["qwen3"]):
        with pytest.raises(ValueError, match=r"reasoning_parser \(.*\) must be one of deepseek_r1, qwen3 "
                                             r"\(how a thinking model writes"):
            settings_from_args({"reasoning_parser": bad})
    flags = {k: "--" + k.replace("_", "-") for k in SERVER_ARGS}
    serve = lambda *argv: settings_from_args(server_args(build_parser().parse_args(["serve", *argv])), flags)
    assert serve("--reasoning-parser", "deepseek_r1").reasoning_parser == "deepseek_r1"
    assert serve().reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])


def test_which_requests_have_their_thinking_split():
    assert chat(None).reasoning() is None  # no parser: all content
    assert chat("qwen3").reasoning() == ("qwen3", True) and chat("qwen3").skip_special_tokens is False  # vLLM's
    assert chat("qwen3", chat_template_kwargs={"enable_thinking": False}).reasoning() == ("qwen3", False)
    assert chat("deepseek_r1").reasoning() == ("deepseek_r1", True) and chat("deepseek_r1").skip_special_tokens
    # a structured output, forced tool calls included, starts after the thinking's end token (the
    # app's settle_thinking); where the tokenizer has none, from the first token: all content
    for fields in ({"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"},
                   {"structured_outputs": {"regex": "[0-9]+"}}):
        waiting = chat("deepseek_r1", **fields)
        assert waiting.sampling().structured_output.after_token is None  # made before: made again below
        waiting.settle_thinking(4242)
        assert waiting.reasoning() == ("deepseek_r1", True)
        assert waiting.sampling().structured_output.after_token == 4242
        unsplit = chat("deepseek_r1", **fields)
        unsplit.settle_thinking(None)
        assert unsplit.reasoning() is None and unsplit.sampling().structured_output.after_token is None
        off = chat("qwen3", chat_template_kwargs={"enable_thinking": False}, **fields)
        off.settle_thinking(4242)  # no thinking: constrained at once, all content
        assert off.reasoning() == ("qwen3", False) and off.sampling().structured_output.after_token is None
        hidden = chat("deepseek_r1", include_reasoning=False, **fields)  # vLLM: constrained at once, no thinking
        hidden.settle_thinking(4242, 4241, [1, 4241, 2])
        assert hidden.reasoning() is None and hidden.sampling().structured_output.after_token is None
    plain = chat("qwen3", "hermes", tools=TOOLS)  # "auto": free text, nothing to wait for
    plain.settle_thinking(4242)
    assert plain.reasoning() == ("qwen3", True) and plain.sampling().structured_output is None
    assert chat("deepseek_r1", include_reasoning=False).reasoning() == ("deepseek_r1", True)  # split, then hidden
    # a prompt whose thinking is already over (its last </think> after its last <think>: Qwen3's template
    # with thinking off, a continued final message): the output is all content, constrained at once
    # within the turn the output goes on: an earlier message's thinking (Qwen3 writes an assistant's
    # back after the last user message: a tool call and its result), before a turn's end (8), does not
    for prompt, over in (([1, 4241, 7, 4242, 9], True), ([4242, 3, 4241, 5], False), ([1, 2], False),
                         ([1, 4241, 7, 4242, 9, 8, 3, 8, 5], False), ([1, 8, 4241, 7, 4242, 9], True)):
        for fields in ({}, {"response_format": {"type": "json_object"}}):
            request = chat("qwen3", **fields)
            request.settle_thinking(4242, 4241, prompt, frozenset({8}))
            assert (request.reasoning() is None) is over, (prompt, fields)
            if fields:
                assert request.sampling().structured_output.after_token == (None if over else 4242)
    # a continued final message goes on with answer text, unless its turn opened a thinking left open:
    # DeepSeek-R1's template writes neither tag for it (the continuation was all reasoning)
    continued = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}],
                 "continue_final_message": True, "add_generation_prompt": False}
    for prompt, over in (([8, 3, 8, 5, 6], True), ([5, 6], True), ([8, 4241, 5, 6], False)):
        request = chat("deepseek_r1", **continued)
        request.settle_thinking(4242, 4241, prompt, frozenset({8}))
        assert (request.reasoning() is None) is over, prompt
    with pytest.raises(ProtocolError) as refused:
        chat("qwen3", include_reasoning="no")
    assert refused.value.param == "include_reasoning"


def rendered(request: ChatCompletionRequest, text: str, cuts: list[int]) -> tuple[dict, list[dict]]:
    """(the whole answer's choice, the streamed chunks' deltas) of `text` cut at `cuts`, as the route's
    renderer makes them for `request`."""
    pieces = TokenPieces(None)
    whole = ChatRender(pieces, False, 0, None, True, request.tool_call_reader(), request.reasoning(),
                       request.include_reasoning)
    streamed = ChatRender(pieces, False, 0, None, True, request.tool_call_reader(), request.reasoning(),
                          request.include_reasoning)
    bounds = [0, *cuts, len(text)]
    deltas = [StreamDelta("r", text[a:b], [], "stop" if b == len(text) else None) for a, b in zip(bounds, bounds[1:])]
    meta = ResponseMeta("chatcmpl-x", 0, "m")
    chunks = [streamed.chunk(meta, delta) for delta in deltas]
    for delta in deltas:
        whole.collect(delta)
    return whole.choice("stop"), [c["choices"][0] for c in chunks if c is not None]


def joined(choices: list[dict], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in choices)


def test_the_thinking_goes_to_reasoning_whole_and_streamed_and_the_rest_to_the_tool_call_reader():
    request = chat("qwen3", "hermes", tools=TOOLS)
    rng = random.Random(5)
    for cuts in ([], [3], [9, 30], sorted(rng.sample(range(1, len(THOUGHT_AND_CALL)), 12))):
        choice, streamed = rendered(request, THOUGHT_AND_CALL, cuts)
        message = choice["message"]
        assert message["reasoning"] == "\nThe user wants Paris.\n" and message["content"] == "\n\nLet me check."
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert choice["finish_reason"] == "tool_calls"
        assert joined(streamed, "reasoning") == message["reasoning"] and joined(streamed, "content") == message["content"]
        calls = reassembled([c for s in streamed for c in s["delta"].get("tool_calls", [])])
        assert [c["function"]["name"] for c in calls] == ["weather"] and streamed[-1]["finish_reason"] == "tool_calls"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_thinking_off_include_reasoning_false_and_no_parser():
    text = "<think>\nhm\n</think>\n\nBlue."
    off, streamed = rendered(chat("qwen3", chat_template_kwargs={"enable_thinking": False}), text, [5])
    assert off["message"] == {"role": "assistant", "content": text, "reasoning": None}
    assert joined(streamed, "content") == text and joined(streamed, "reasoning") == ""
    hidden, streamed = rendered(chat("deepseek_r1", include_reasoning=False), "hm</think>Blue.", [1, 4])
    assert hidden["message"] == {"role": "assistant", "content": "Blue."} and joined(streamed, "reasoning") == ""
    assert joined(streamed, "content") == "Blue."
    plain, _ = rendered(chat(None), text, [])
    assert plain["message"] == {"role": "assistant", "content": text}  # no reasoning key without a parser
    cut, streamed = rendered(chat("deepseek_r1"), "still thinking", [6])  # no </think>: all reasoning
    assert cut["message"] == {"role": "assistant", "content": None, "reasoning": "still thinking"}
    for parser in ("hermes", "llama3_json", "mistral"):  # content null beside a tool-call parser too
        cut, _ = rendered(chat("deepseek_r1", parser, tools=TOOLS), "still thinking", [6])
        assert cut["message"] == {"role": "assistant", "content": None, "reasoning": "still thinking"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("reasoning"))


def test_a_thinking_servers_answers_end_to_end(model_dir, in_process_cluster):
    """A random model writes no </think>: under deepseek_r1 its whole text is the reasoning (content
    null), the same text a server without the parser gives as content, whole and streamed alike;
    qwen3 with thinking off gives it as content."""
    from launcher.api import Launcher
    from tests.test_skip_special_tokens import answered, replica_over

    route = "/v1/chat/completions"
    asked = {**BASE, "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 2}
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)

        async def every():
            server.reasoning_parser = None
            plain = await answered(server, route, asked)
            server.reasoning_parser = "deepseek_r1"  # as OpenAIServer's constructor sets it from the settings
            thought = await answered(server, route, asked)
            streamed = await answered(server, route, {**asked, "stream": True})
            scored = await answered(server, route, {**asked, "logprobs": True})
            unscored = await answered(server, route, {**asked, "logprobs": True, "include_reasoning": False})
            server.reasoning_parser = "qwen3"
            off = await answered(server, route, {**asked, "chat_template_kwargs": {"enable_thinking": False}})
            return plain, thought, streamed, off, scored, unscored

        plain, thought, streamed, off, scored, unscored = asyncio.run(every())

    texts = [c["message"]["content"] for c in plain["choices"]]
    assert all(texts) and "</think>" not in "".join(texts)
    assert [c["message"]["reasoning"] for c in thought["choices"]] == texts
    assert [c["message"]["content"] for c in thought["choices"]] == [None, None]
    for i, text in enumerate(texts):
        assert "".join(c["delta"].get("reasoning") or "" for chunk in streamed for c in chunk["choices"]
                       if c["index"] == i) == text
        assert not any(c["delta"].get("content") for chunk in streamed for c in chunk["choices"] if c["index"] == i)
    assert [c["message"]["content"] for c in off["choices"]] == texts
    # without the reasoning, no logprobs either: their tokens would spell it (vLLM's rule)
    assert all(len(c["logprobs"]["content"]) > 0 for c in scored["choices"])
    assert [c["logprobs"] for c in unscored["choices"]] == [None, None]
    assert [c["message"] for c in unscored["choices"]] == [{"role": "assistant", "content": None}] * 2
    assert [c["message"]["reasoning"] for c in off["choices"]] == [None, None]


def test_the_think_tags_are_the_tokenizers_own_tokens_the_model_can_generate(smollm2_tokenizer):
    import copy

    from launcher.serving.openai_app import _generated_tags
    from launcher.serving.reasoning import THINK_END, THINK_START

    def _think_tokens(tokenizer, vocab_size):  # the ids the server looks up, as its constructor does
        return _generated_tags(tokenizer, vocab_size, (THINK_START, THINK_END))

    assert _think_tokens(smollm2_tokenizer, 49152) == (None, None)  # SmolLM2 has no such tokens
    tagged = copy.deepcopy(smollm2_tokenizer)
    tagged.add_tokens(["<think>", "</think>"])
    start, end = tagged.convert_tokens_to_ids(["<think>", "</think>"])
    assert _think_tokens(tagged, end + 1) == (start, end)
    assert _think_tokens(tagged, start + 1) == (start, None)  # past the model's vocabulary: never generated


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
              "{% if m.role == 'assistant' and m.reasoning %}<think>\n{{ m.reasoning }}\n</think>\n\n{% endif %}"
              "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>"
              "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A cut-down Qwen3 template: it writes an assistant message's reasoning back between think tags."""


def test_an_earlier_turns_thinking_in_the_prompt_leaves_the_new_answers_split(smollm2_tokenizer):
    """A review: Qwen3's template writes back the thinking of the assistant's messages after the last
    user message (a tool call, its result), and the prompt's last </think> after its last <think>
    read as the new answer's thinking already closed: the model's new thinking, tags and all, went
    to the content, whole and streamed (reasoning null, 0 reasoning tokens)."""
    import copy

    from tests.test_skip_special_tokens import answered
    from tests.test_tokenize_routes import scripted_server

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_LIKE
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    after_a_call = asked + [
        {"role": "assistant", "content": None, "reasoning": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for messages in (asked, after_a_call):
        server = scripted_server(tokenizer, "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.",
                                 reasoning_parser="qwen3")
        body = {"model": "smollm2-135m-instruct", "messages": messages}
        whole = asyncio.run(answered(server, "/v1/chat/completions", body))["choices"][0]["message"]
        assert (whole["reasoning"], whole["content"]) == ("\nThe tool says sunny.\n", "\n\nIt is sunny."), messages
        chunks = asyncio.run(answered(server, "/v1/chat/completions", {**body, "stream": True}))
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == whole["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    assert "</think>" in server.prompts[-1]  # the earlier turn's thinking was in the prompt
