"""A stop token that ends an answer and is left out of its text (the tokenizer's EOS, SmolLM2's
`<|im_end|>`, or one of the request's stop_token_ids) is left out of its logprobs too, on chat and
completions, whole and streamed: a client reads the logprobs as the text's tokens (it listed
'<|im_end|>' after the content). The usage still counts it, as the token was generated. Where the
text keeps the token (include_stop_str_in_output, with skip_special_tokens false for a special
one), its entry stays. In-process over a scripted engine read through a real TextStream and SmolLM2's
real tokenizer, as the Launcher's astream reads it."""

from __future__ import annotations

import pytest

from launcher.serving.text_stream import TextStream
from tests.test_openai_stop_reason import CHAT, COMPLETION, SCRIPT, script_ids, text_stream_server
from tests.test_stream_interval_server import run_route
from workers.serving.requests import TokenEvent, TokenLogprob


def _scored(token: int, n: int, logprobs: int) -> list:
    """The n-th token at -n/10, its alternatives itself and ids 0, 1, ... at -1."""
    top = [(token, -n / 10), *[(t, -1.0) for t in range(logprobs - 1)]]
    return [TokenLogprob(token, -n / 10, top=top[:logprobs])]


def logprob_server(tokenizer, script: str):
    """tests/test_openai_stop_reason.text_stream_server's engine, its tokens scored (_scored)."""
    return text_stream_server(tokenizer, script, scored=_scored)


ROUTES = [("/v1/completions", {**COMPLETION, "logprobs": 1}), ("/v1/chat/completions", {**CHAT, "logprobs": True})]


def whole_answer(tokenizer, route: str, body: dict) -> tuple[str, list[str], int]:
    """(the text, its logprobs' tokens, the usage's completion tokens)."""
    answer = run_route(logprob_server(tokenizer, SCRIPT), route, body)
    choice = answer["choices"][0]
    if route == "/v1/completions":
        return choice["text"], choice["logprobs"]["tokens"], answer["usage"]["completion_tokens"]
    return (choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]],
            answer["usage"]["completion_tokens"])


def streamed_answer(tokenizer, route: str, body: dict) -> tuple[str, list[str], int, list[str]]:
    """whole_answer's, streamed, and the tokens of the chunk that carries the finish_reason."""
    chunks = run_route(logprob_server(tokenizer, SCRIPT), route,
                       {**body, "stream": True, "stream_options": {"include_usage": True}})
    text, tokens, last = [], [], []
    for chunk in chunks:
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        if route == "/v1/completions":
            told = choice["logprobs"]["tokens"] if choice["logprobs"] else []
            text.append(choice["text"])
        else:
            told = [e["token"] for e in choice["logprobs"]["content"]] if choice.get("logprobs") else []
            text.append(choice["delta"].get("content") or "")
        tokens += told
        if choice["finish_reason"] is not None:
            last = told
    return "".join(text), tokens, chunks[-1]["usage"]["completion_tokens"], last


@pytest.mark.parametrize("route, body", ROUTES, ids=["completions", "chat"])
def test_the_eos_that_ended_the_answer_has_no_logprob_but_is_counted(smollm2_tokenizer, route, body):
    tok = smollm2_tokenizer
    generated = len(script_ids(tok, SCRIPT)) + 1  # the EOS too
    text, tokens, counted = whole_answer(tok, route, body)
    assert text == SCRIPT and "".join(tokens) == text and tok.eos_token not in tokens, tokens
    assert counted == generated
    text, tokens, counted, last = streamed_answer(tok, route, body)
    assert text == SCRIPT and "".join(tokens) == text and tok.eos_token not in tokens, tokens
    assert tok.eos_token not in last and counted == generated


@pytest.mark.parametrize("route, body", ROUTES, ids=["completions", "chat"])
def test_a_stop_token_id_that_ended_the_answer_has_no_logprob(smollm2_tokenizer, route, body):
    tok = smollm2_tokenizer
    comma = script_ids(tok, ",")[0]
    asked = {**body, "stop_token_ids": [comma]}
    for text, tokens, counted, *_ in (whole_answer(tok, route, asked), streamed_answer(tok, route, asked)):
        assert text == "The capital of France is Paris" and "".join(tokens) == text, tokens
        assert counted == len(script_ids(tok, "The capital of France is Paris,"))  # the comma counted


@pytest.mark.parametrize("route, body", ROUTES, ids=["completions", "chat"])
def test_a_stop_token_the_text_keeps_keeps_its_logprob(smollm2_tokenizer, route, body):
    tok = smollm2_tokenizer
    kept = {**body, "include_stop_str_in_output": True, "skip_special_tokens": False}
    for text, tokens, *_ in (whole_answer(tok, route, kept), streamed_answer(tok, route, kept)):
        assert text == SCRIPT + tok.eos_token and tokens[-1] == tok.eos_token and "".join(tokens) == text, tokens


def test_an_event_of_several_tokens_ending_on_the_eos_says_it_hid_it(smollm2_tokenizer):
    """A stream_interval's event is read a token at a time: the merged delta says the last was hidden."""
    tok = smollm2_tokenizer
    ids = script_ids(tok, " Paris.") + [tok.eos_token_id]
    stream = TextStream("r", tok, (), 3, stop_token_ids=(tok.eos_token_id,))
    delta = stream.delta(TokenEvent("r", ids, "stop", [TokenLogprob(t, -0.1) for t in ids]))
    assert delta.stop_token_hidden and delta.text == " Paris." and delta.token_ids == ids
    cut = TextStream("r", tok, (), 3, stop_token_ids=(tok.eos_token_id,)).delta(TokenEvent("r", ids[:-1], "length"))
    assert not cut.stop_token_hidden  # "length": nothing left out
