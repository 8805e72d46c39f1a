"""Completions' `echo`, in-process (no server): the prompt's text comes first in the choice's text,
in the first streamed chunk, and with logprobs the prompt's tokens come first in the logprobs
object (the first with null log-probability, as OpenAI's), the completion's offsets moved on by
the echoed text's length."""

from __future__ import annotations

from types import SimpleNamespace

from launcher.serving import openai_protocol as proto
from launcher.serving.echoed_prompt import echoed_prompt
from launcher.serving.openai_protocol import CompletionRequest, parse_request
from launcher.serving.openai_render import CompletionRender
from launcher.serving.stream_types import StreamDelta
from launcher.serving.token_pieces import TokenPieces
from workers.serving.requests import TokenLogprob

MODEL = "m"
WORDS = {1: "The", 2: " sky", 3: " is", 4: " blue", 5: "."}
PIECES = TokenPieces(SimpleNamespace(
    decode=lambda ids, skip_special_tokens=False, **options: "".join(WORDS[i] for i in ids)))
META = proto.ResponseMeta("x", 1, MODEL)
PROMPT_ENTRIES = [TokenLogprob(2, -3.0, [(4, -1.0)]), TokenLogprob(3, -0.5, [(3, -0.5)])]


def deltas():
    return [StreamDelta("r", " blue", [4], None, 3, 1, [TokenLogprob(4, -0.2, [(4, -0.2)])],
                        prompt_logprobs=PROMPT_ENTRIES),
            StreamDelta("r", ".", [5], "length", 3, 2, [TokenLogprob(5, -0.1, [(5, -0.1)])])]


def test_echo_is_accepted_and_a_number_is_not_a_boolean():
    req = parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1})
    assert req.echo is True and req.logprobs == 1


def test_echo_with_logprobs_puts_the_prompt_first_in_text_and_logprobs():
    echo = echoed_prompt(PIECES, "The sky is", [1, 2, 3], with_logprobs=True)
    assert echo.text == "The sky is" and echo.offsets == (0, 3, 7)
    render = CompletionRender(PIECES, logprobs=True, echo=echo)
    for d in deltas():
        render.collect(d)
    choice = render.choice("length")
    assert choice["text"] == "The sky is blue."
    lp = choice["logprobs"]
    assert lp["tokens"] == ["The", " sky", " is", " blue", "."]
    assert lp["token_logprobs"] == [None, -3.0, -0.5, -0.2, -0.1]
    assert lp["top_logprobs"] == [None, {" blue": -1.0, " sky": -3.0}, {" is": -0.5}, {" blue": -0.2}, {".": -0.1}]
    assert lp["text_offset"] == [0, 3, 7, 10, 15]
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token
    # streamed: the prompt with the first chunk, and the same object once the chunks are joined
    render = CompletionRender(PIECES, logprobs=True, echo=echo)
    chunks = [render.chunk(META, d)["choices"][0] for d in deltas()]
    assert [c["text"] for c in chunks] == ["The sky is blue", "."]
    assert proto.merge_completion_logprobs([c["logprobs"] for c in chunks]) == lp


def test_echo_without_logprobs_and_of_token_ids():
    by_ids = echoed_prompt(PIECES, [1, 2, 3], [1, 2, 3], with_logprobs=False)
    assert by_ids.text == "The sky is" and by_ids.offsets is None  # token ids come back decoded
    render = CompletionRender(PIECES, logprobs=False, echo=by_ids)
    first = render.chunk(META, StreamDelta("r", "", [4], None, 3, 1))  # its text held back: the echo is not
    assert first["choices"][0]["text"] == "The sky is" and first["choices"][0]["logprobs"] is None
    assert render.chunk(META, StreamDelta("r", " blue", [5], "stop", 3, 2))["choices"][0]["text"] == " blue"
    render = CompletionRender(PIECES, logprobs=False, echo=echoed_prompt(PIECES, "  raw  text", [1], False))
    for d in deltas():
        render.collect(d)
    assert render.choice("length")["text"] == "  raw  text blue."  # a text prompt comes back as sent


def test_a_one_token_prompt_echoes_one_null_entry():
    echo = echoed_prompt(PIECES, [1], [1], with_logprobs=True)
    render = CompletionRender(PIECES, logprobs=True, echo=echo)
    first = deltas()[0]
    first.prompt_logprobs = []
    chunk = render.chunk(META, first)["choices"][0]
    assert chunk["text"] == "The blue" and chunk["logprobs"]["tokens"] == ["The", " blue"]
    assert chunk["logprobs"]["token_logprobs"] == [None, -0.2] and chunk["logprobs"]["text_offset"] == [0, 3]


def test_max_tokens_zero_is_taken_with_echo_alone():
    import pytest

    from launcher.serving.openai_protocol import ProtocolError

    req = parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": 0})
    assert req.max_tokens == 0
    with pytest.raises(ProtocolError, match=r"max_tokens \(0\) must be an integer >= 1; 0 is taken only with echo"):
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "max_tokens": 0})
    with pytest.raises(ProtocolError, match=r"min_tokens \(2\) must be at most max_tokens \(0\)"):
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": 0,
                                          "min_tokens": 2})
    with pytest.raises(ProtocolError, match=r"max_tokens \(-1\) must be an integer >= 1"):
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": -1})


def test_echo_only_drops_the_one_token_the_engine_generated():
    echo = echoed_prompt(PIECES, "The sky is", [1, 2, 3], with_logprobs=True)
    first = deltas()[0]
    first.finish_reason = "stop"  # the dropped token was EOS, say: the answer still ends for "length"
    render = CompletionRender(PIECES, logprobs=True, echo=echo, echo_only=True)
    chunk = render.chunk(META, first)["choices"][0]
    assert chunk["text"] == "The sky is" and chunk["finish_reason"] == "length"
    assert chunk["logprobs"]["tokens"] == ["The", " sky", " is"]
    assert chunk["logprobs"]["token_logprobs"] == [None, -3.0, -0.5]
    assert render.completion_tokens(first) == 0
    render = CompletionRender(PIECES, logprobs=False, echo=echo, echo_only=True)
    render.collect(first)
    assert render.choice("stop") == {"index": 0, "text": "The sky is", "logprobs": None, "finish_reason": "length",
                                     "stop_reason": None}


def test_vllm_prompt_logprobs_list_the_prompt_token_first_with_its_rank():
    from launcher.serving.openai_protocol import ChatCompletionRequest
    from launcher.serving.openai_render import ChatRender

    entries = [TokenLogprob(2, -3.0, [(4, -1.0), (2, -3.0), (5, -4.0)], rank=2),
               TokenLogprob(3, -0.5, [(3, -0.5), (1, -2.0), (2, -6.0)], rank=1)]
    listed = proto.vllm_prompt_logprobs(entries, PIECES, 2)
    assert listed == [None,
                      {"2": {"logprob": -3.0, "rank": 2, "decoded_token": " sky"},
                       "4": {"logprob": -1.0, "rank": 1, "decoded_token": " blue"}},
                      {"3": {"logprob": -0.5, "rank": 1, "decoded_token": " is"},
                       "1": {"logprob": -2.0, "rank": 2, "decoded_token": "The"}}]
    first = StreamDelta("r", " blue", [4], "length", 3, 1, prompt_logprobs=entries)
    render = CompletionRender(PIECES, logprobs=False, prompt_top=2)
    render.collect(first)
    assert render.choice("length")["prompt_logprobs"] == listed and render.response_extras() == {}
    chat = ChatRender(PIECES, logprobs=False, prompt_top=2)
    chat.collect(first)
    assert chat.response_extras() == {"prompt_logprobs": listed} and "prompt_logprobs" not in chat.choice("length")
    # the engine lists max(prompt_logprobs, echo's logprobs) alternatives; echo keeps its own number
    echo = echoed_prompt(PIECES, "The sky is", [1, 2, 3], with_logprobs=True)
    render = CompletionRender(PIECES, logprobs=True, echo=echo, prompt_top=2, top_n=1)
    render.collect(first)
    choice = render.choice("length")
    assert choice["logprobs"]["top_logprobs"][1:3] == [{" blue": -1.0, " sky": -3.0}, {" is": -0.5}]
    assert choice["prompt_logprobs"] == listed
    both = parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1,
                                             "prompt_logprobs": 3})
    assert both.engine_prompt_logprobs() == 3
    assert parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "logprobs": 4}).engine_prompt_logprobs() is None
    chat_req = parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                     "prompt_logprobs": 0, "logprobs": True})
    assert chat_req.engine_prompt_logprobs() == 0


def test_prompt_logprobs_are_refused_when_streamed_or_out_of_range():
    import pytest

    from launcher.serving.openai_protocol import ProtocolError

    with pytest.raises(ProtocolError, match=r"prompt_logprobs \(2\) is not available with stream: true") as caught:
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 2, "stream": True})
    assert caught.value.param == "prompt_logprobs"
    with pytest.raises(ProtocolError, match=r"prompt_logprobs \(21\) must be an integer in \[0, 20\]"):
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21})


def test_echoed_offsets_point_into_the_text_through_control_tokens(smollm2_tokenizer):
    """A completions prompt's control tokens are read as such: the echoed text keeps them (as sent,
    or decoded from token ids), so every offset after one still points at its token."""
    pieces = TokenPieces(smollm2_tokenizer)
    text = "a<|im_start|>user\nhi <|im_end|> ok"
    ids = smollm2_tokenizer(text)["input_ids"]
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # read as the control token
    for sent in (text, ids):
        echo = echoed_prompt(pieces, sent, ids, with_logprobs=True)
        assert echo.text == text
        entries = [TokenLogprob(t, -1.0) for t in ids[1:]]
        lp = CompletionRender(pieces, logprobs=True, echo=echo)
        [bang] = smollm2_tokenizer("!")["input_ids"]
        lp.collect(StreamDelta("r", "!", [bang], "length", len(ids), 1, [TokenLogprob(bang, -0.5)],
                               prompt_logprobs=entries))
        choice = lp.choice("length")
        for token, offset in zip(choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]):
            assert choice["text"][offset:].startswith(token), (token, offset, choice["text"])


def test_a_refusal_about_the_whole_request_names_no_prompt_of_several():
    import pytest

    from launcher.serving.openai_app import _naming_prompt
    from launcher.serving.openai_protocol import ProtocolError

    for param, named in (("prompt", True), ("max_tokens", True), ("logit_bias", False), ("stop_token_ids", False),
                         ("min_tokens", False)):
        with pytest.raises(ProtocolError) as caught, _naming_prompt(1, 2):
            raise ProtocolError("something about it", param=param)
        assert caught.value.message.startswith("prompt[1]: ") == named and caught.value.param == param
    with pytest.raises(ProtocolError) as caught, _naming_prompt(1, 2):  # a full queue: the whole request's
        raise ProtocolError("at capacity", status=503)
    assert caught.value.message == "at capacity"
    with pytest.raises(ProtocolError) as caught, _naming_prompt(0, 1):  # one prompt: named as "prompt" already
        raise ProtocolError("prompt is empty", param="prompt")
    assert caught.value.message == "prompt is empty"
