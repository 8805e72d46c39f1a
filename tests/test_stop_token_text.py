"""A stop token that ends a request leaves its text out of the text, special or not, as vLLM's
detokenizer leaves it out (unless include_stop_str_in_output): streams, generate() (continuous and
static) and both HTTP routes; its id stays in the token ids and the usage counts it. generate() takes
skip_special_tokens as stream() does. Checked on the text stream with SmolLM2's real tokenizer, then
over a real in-process Launcher (a small random model with SmolLM2's tokenizer, made to generate
the token by allowed_token_ids)."""

from __future__ import annotations

import asyncio

import pytest

from launcher.serving.text_stream import TextStream
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_skip_special_tokens import END, NEW, answered_both_ways, choice_texts, end_id, replica_over
from workers.serving.requests import TokenEvent

WORD = " world"


def word_id(tokenizer) -> int:
    [token] = tokenizer.encode(WORD)
    return token


def pushed(tokenizer, ids: list[int], finish: str, **options) -> str:
    """The text of `ids` pushed one event per token, the last one ending the request with `finish`."""
    stream = TextStream("r", tokenizer, (), prompt_tokens=1, **options)
    return "".join(stream.delta(TokenEvent("r", [token], finish if i == len(ids) - 1 else None)).text
                   for i, token in enumerate(ids))


# ---- the text stream -------------------------------------------------------------------------------
def test_a_plain_stop_token_that_ends_the_request_leaves_its_text_out_unless_asked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    word = word_id(tok)
    ids = tok.encode("Hello") + [word] + tok.encode(" and") + [word]
    assert pushed(tok, ids, "stop", stop_token_ids=(word,)) == "Hello world and"
    assert pushed(tok, ids, "stop", stop_token_ids=(word,), include_stop_str_in_output=True) == "Hello world and world"
    # the same token ending the request by length, or a request whose stop ids do not hold it
    assert pushed(tok, ids, "length", stop_token_ids=(word,)) == "Hello world and world"
    assert pushed(tok, ids, "stop", stop_token_ids=(end_id(tok),)) == "Hello world and world"


def test_a_structured_outputs_last_token_ending_the_request_keeps_its_text(smollm2_tokenizer):
    """A structured output that matched whole ends with "stop" on a token that is no stop token (the
    leader never ends a match on one): its text is the output's last piece and stays."""
    tok = smollm2_tokenizer
    ids = tok.encode('{"a": 1}')
    assert pushed(tok, ids, "stop", stop_token_ids=(end_id(tok),)) == '{"a": 1}'


# ---- the driver API and the HTTP routes, over a real in-process Launcher ---------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("stoptext"))


def only(token: int, **options) -> dict:
    from shardlib.sampling_params import SamplingParams

    return dict(sampling=SamplingParams(temperature=0.0, allowed_token_ids=[token]), max_new_tokens=NEW, **options)


def test_the_driver_leaves_an_ending_stop_tokens_text_out_and_generate_takes_skip_special_tokens(
        model_dir, in_process_cluster):
    from launcher.api import Launcher

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        word = word_id(llm.tokenizer)
        ended = {batching: llm.generate(["Hi"], stop_token_ids=[word], batching=batching, **only(word))[0]
                 for batching in ("continuous", "static")}
        streamed = list(llm.stream("Hi", stop_token_ids=[word], **only(word)))
        shown = list(llm.stream("Hi", stop_token_ids=[word], include_stop_str_in_output=True, **only(word)))
        kept = {batching: llm.generate(["Hi"], skip_special_tokens=False, ignore_eos=True, batching=batching,
                                       **only(end_id(llm.tokenizer)))[0]
                for batching in ("continuous", "static")}
        skipped = llm.generate(["Hi"], ignore_eos=True, **only(end_id(llm.tokenizer)))[0]
        # what ended each: the stop token id, or nothing for the tokenizer's EOS
        by_eos = {batching: llm.generate(["Hi"], batching=batching, **only(end_id(llm.tokenizer)))[0]
                  for batching in ("continuous", "static")}
        # under ignore_eos the EOS ends an answer only as a stop token id asked for: then it is named
        eos_asked = {batching: llm.generate(["Hi"], batching=batching, ignore_eos=True,
                                            stop_token_ids=[end_id(llm.tokenizer)], **only(end_id(llm.tokenizer)))[0]
                     for batching in ("continuous", "static")}
        for batching in ("continuous", "static"):
            with pytest.raises(ValueError, match=r"^skip_special_tokens \('no'\) must be True or False$"):
                llm.generate(["Hi"], skip_special_tokens="no", batching=batching)

        async def agenerated():
            return (await llm.agenerate(["Hi"], stop_token_ids=[word], **only(word)))[0], \
                (await llm.agenerate(["Hi"], skip_special_tokens=False, ignore_eos=True,
                                     **only(end_id(llm.tokenizer))))[0]

        ended_async, kept_async = asyncio.run(agenerated())
    for result in (*ended.values(), ended_async):
        assert (result.text, result.token_ids, result.finish_reason) == ("", [word], "stop")
        assert result.stop_reason == word
    for result in by_eos.values():
        assert (result.finish_reason, result.stop_reason) == ("stop", None)
    for result in eos_asked.values():
        assert (result.finish_reason, result.stop_reason) == ("stop", end_id(llm.tokenizer))
    assert ("".join(d.text for d in streamed), [t for d in streamed for t in d.token_ids]) == ("", [word])
    assert "".join(d.text for d in shown) == WORD
    for result in (*kept.values(), kept_async):
        assert (result.text, result.finish_reason, result.stop_reason) == (END * NEW, "length", None)
    assert skipped.text == "" and len(skipped.token_ids) == NEW


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_both_routes_leave_an_ending_stop_tokens_text_out_unless_asked(model_dir, in_process_cluster, route, stream):
    from launcher.api import Launcher

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)
        word = word_id(llm.tokenizer)
        fields = {"max_tokens": NEW, "temperature": 0, "allowed_token_ids": [word], "stop_token_ids": [word]}
        _, left_out, shown = answered_both_ways(server, route, stream, fields, {"include_stop_str_in_output": True})
    assert choice_texts(route, left_out, 2) == ["", ""]
    assert choice_texts(route, shown, 2) == [WORD] * 2
    for answer in (left_out, shown):
        usage = answer if isinstance(answer, dict) else answer[-1]
        assert usage["usage"]["completion_tokens"] == 2  # one token a choice, counted though not shown
        if isinstance(answer, dict):
            assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "stop"]
