"""/v1/responses takes the extra parameters vLLM's Responses request takes (seed, stop,
repetition_penalty, ignore_eos) and the chat route's own extensions (min_tokens,
chat_template_kwargs, include_reasoning), handed to the chat request by their own names
(launcher/serving/responses/request.py, PASSED_AS_IS): they were refused as unknown parameters,
repetition_penalty with the hint "did you mean 'presence_penalty'?". Checked by what reaches the
engine (the sampling and the stream's options), the prompt and the output items."""

from __future__ import annotations

import copy

from launcher.serving.responses import chat_body
from tests.test_responses_route import asked, check_with_the_clients_types, refusal, respond, server_over
from tests.test_responses_route import tokenizer  # noqa: F401  (the module-scoped fixture)


def engine_calls(server) -> list[tuple]:
    """The scripted engine's calls from now on, as (sampling, options) each."""
    calls, original = [], server.launcher.astream

    def astream(prompt, sampling, max_new_tokens, logprobs=None, **options):
        calls.append((sampling, options))
        return original(prompt, sampling, max_new_tokens, logprobs, **options)

    server.launcher.astream = astream
    return calls


def test_vllms_extra_parameters_reach_the_engine(tokenizer):
    server = server_over(tokenizer, "The sky is blue.")
    calls = engine_calls(server)
    for stream in (False, True):
        answer = respond(server, asked(seed=7, repetition_penalty=1.25, ignore_eos=True,
                                       min_tokens=2, temperature=0.5, stream=stream))
        check_with_the_clients_types(answer)
        sampling, options = calls[-1]
        assert (sampling.seed, sampling.repetition_penalty, sampling.min_tokens) == (7, 1.25, 2)
        assert options["ignore_eos"] is True
    chat, _ = chat_body({"input": "hi", "seed": 3, "ignore_eos": False})
    assert (chat["seed"], chat["ignore_eos"]) == (3, False)


def test_stop_strings_reach_the_stream(tokenizer):
    server = server_over(tokenizer, "The sky is blue.")
    calls = engine_calls(server)
    for stream in (False, True):
        check_with_the_clients_types(respond(server, asked(stop=[" is", "!"], stream=stream)))
        assert tuple(calls[-1][1]["stop"]) == (" is", "!")


def test_chat_template_kwargs_reach_the_template(tokenizer):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}[{{ flavour }}]"
    server = server_over(templated, "Blue.")
    respond(server, asked(chat_template_kwargs={"flavour": "mint"}))
    assert server.prompts[-1].endswith("[mint]")


def test_include_reasoning_false_leaves_the_reasoning_item_out(tokenizer):
    thought = "The sky scatters blue light.</think>Blue."
    told = respond(server_over(tokenizer, thought, reasoning_parser="deepseek_r1"), asked())
    assert [item["type"] for item in told["output"]] == ["reasoning", "message"]
    for stream in (False, True):
        answer = respond(server_over(tokenizer, thought, reasoning_parser="deepseek_r1"),
                         asked(include_reasoning=False, stream=stream))
        output = answer["output"] if not stream else answer[-1]["response"]["output"]
        assert [item["type"] for item in output] == ["message"]
        assert output[0]["content"][0]["text"] == "Blue."


def test_their_values_are_still_checked_by_the_chat_parser(tokenizer):
    server = server_over(tokenizer, "Blue.")
    refused = refusal(server, asked(repetition_penalty=0))
    assert refused.status == 400 and refused.param == "repetition_penalty" and "unknown" not in refused.message
    refused = refusal(server, asked(seed="x"))
    assert refused.param == "seed" and "unknown" not in refused.message
