"""stop_reason on completions and chat choices: the stop string that matched, or the stop token id
that ended the answer (one of stop_token_ids, or an end token other than the tokenizer's own EOS);
null for the tokenizer's EOS and for "length". On a whole answer's every choice, and on the streamed
chunk that carries the finish_reason. From the stop-string matcher, through the text stream (SmolLM2's
real tokenizer), the renders, and the HTTP routes in-process over an engine that runs a real
TextStream."""

from __future__ import annotations

import pytest

from launcher.serving.openai_protocol import ResponseMeta
from launcher.serving.openai_render import ChatRender, CompletionRender
from launcher.serving.stop_strings import StopStringMatcher
from launcher.serving.text_stream import TextStream
from launcher.serving.token_pieces import TokenPieces
from tests.test_stream_interval_server import run_route
from workers.serving.requests import TokenEvent

MODEL = "smollm2-135m-instruct"
SCRIPT = "The capital of France is Paris, a city on the Seine."


# ---- the matcher --------------------------------------------------------------------------------
@pytest.mark.parametrize("include_stop", [False, True])
def test_the_matcher_says_which_stop_string_it_found(include_stop):
    matcher = StopStringMatcher(["Seine", "Par"], include_stop)
    assert matcher.found is None
    texts = [matcher.push(piece) for piece in ("The capital is ", "P", "aris")]
    assert texts[-1][1] and matcher.found == "Par"
    assert "".join(text for text, _ in texts) == ("The capital is Par" if include_stop else "The capital is ")


def test_the_matcher_names_the_stop_that_ended_first_when_two_match():
    matcher = StopStringMatcher([" world", "or"])
    matcher.push(" Hello w")
    assert matcher.push("orld")[1] and matcher.found == "or"


# ---- the text stream ------------------------------------------------------------------------------
def run_stream(tokenizer, ids, finish_last: str, stops=(), stop_token_ids=(), **options):
    stream = TextStream("r", tokenizer, tuple(stops), 3, stop_token_ids=stop_token_ids, **options)
    deltas = []
    for i, token in enumerate(ids):
        deltas.append(stream.delta(TokenEvent("r", [token], finish_last if i == len(ids) - 1 else None)))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def script_ids(tokenizer, text=SCRIPT) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_is_the_last_deltas_stop_reason(smollm2_tokenizer):
    deltas = run_stream(smollm2_tokenizer, script_ids(smollm2_tokenizer), "length", stops=("Paris",))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "Paris"
    assert all(d.stop_reason is None for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == "The capital of France is "


def test_a_stop_token_id_is_the_stop_reason_and_the_eos_is_none(smollm2_tokenizer):
    tok = smollm2_tokenizer
    comma = script_ids(tok, ",")[0]
    ids = script_ids(tok)
    ending = (comma, tok.eos_token_id)
    by_comma = run_stream(tok, ids[:ids.index(comma) + 1], "stop", stop_token_ids=ending)
    assert (by_comma[-1].finish_reason, by_comma[-1].stop_reason) == ("stop", comma)
    assert "".join(d.text for d in by_comma) == "The capital of France is Paris"  # the stop token's text left out
    by_eos = run_stream(tok, ids + [tok.eos_token_id], "stop", stop_token_ids=ending)
    assert (by_eos[-1].finish_reason, by_eos[-1].stop_reason) == ("stop", None)
    by_length = run_stream(tok, ids[:4], "length", stop_token_ids=ending)
    assert (by_length[-1].finish_reason, by_length[-1].stop_reason) == ("length", None)
    # under ignore_eos the EOS ends an answer only as a stop token id the request named: it is named
    named = run_stream(tok, ids + [tok.eos_token_id], "stop", stop_token_ids=(tok.eos_token_id,), ignore_eos=True)
    assert (named[-1].finish_reason, named[-1].stop_reason) == ("stop", tok.eos_token_id)
    kept = run_stream(tok, ids[:ids.index(comma) + 1], "stop", stop_token_ids=ending, include_stop_str_in_output=True)
    assert kept[-1].stop_reason == comma and "".join(d.text for d in kept).endswith("Paris,")


def test_a_structured_outputs_last_token_names_no_stop(smollm2_tokenizer):
    """"stop" on a token that is no stop token (a structured output's end): nothing to name."""
    ids = script_ids(smollm2_tokenizer)[:5]
    deltas = run_stream(smollm2_tokenizer, ids, "stop", stop_token_ids=(smollm2_tokenizer.eos_token_id,))
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", None)


# ---- the renders --------------------------------------------------------------------------------
@pytest.mark.parametrize("render_of", [lambda p: CompletionRender(p, False), lambda p: ChatRender(p, False)],
                         ids=["completions", "chat"])
def test_the_whole_choice_and_the_finishing_chunk_carry_the_stop_reason(smollm2_tokenizer, render_of):
    meta = ResponseMeta.new("cmpl", MODEL)
    pieces = TokenPieces(smollm2_tokenizer)
    deltas = run_stream(smollm2_tokenizer, script_ids(smollm2_tokenizer), "length", stops=("city",))
    whole, streamed = render_of(pieces), render_of(pieces)
    for delta in deltas:
        whole.collect(delta)
    choice = whole.choice(deltas[-1].finish_reason)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "city")
    chunks = [c for c in (streamed.chunk(meta, d) for d in deltas) if c is not None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == "city"
    # completions' chunks all carry the key, null before the last (as vLLM's); chat's only the last
    chat = isinstance(streamed, ChatRender)
    assert all(("stop_reason" not in c["choices"][0]) if chat else c["choices"][0]["stop_reason"] is None
               for c in chunks[:-1])


def test_a_whole_choice_without_a_stop_says_null(smollm2_tokenizer):
    deltas = run_stream(smollm2_tokenizer, script_ids(smollm2_tokenizer)[:3], "length")
    render = CompletionRender(TokenPieces(smollm2_tokenizer), False)
    for delta in deltas:
        render.collect(delta)
    choice = render.choice("length")
    assert "stop_reason" in choice and choice["stop_reason"] is None


def test_an_echo_only_choice_names_no_stop(smollm2_tokenizer):
    """max_tokens 0 with echo: the one token generated is dropped, and the choice finishes "length"."""
    from launcher.serving.echoed_prompt import EchoedPrompt

    comma = script_ids(smollm2_tokenizer, ",")[0]
    deltas = run_stream(smollm2_tokenizer, [comma], "stop", stop_token_ids=(comma,))
    assert deltas[-1].stop_reason == comma
    render = CompletionRender(TokenPieces(smollm2_tokenizer), False, echo=EchoedPrompt("Hi", (1,)), echo_only=True)
    render.collect(deltas[-1])
    assert (render.choice("stop")["finish_reason"], render.choice("stop")["stop_reason"]) == ("length", None)


# ---- the HTTP routes, in-process ------------------------------------------------------------------
def text_stream_server(tokenizer, script: str, scored=None):
    """tests/test_tokenize_routes.py's scripted server, its engine generating `script`'s tokens and
    then the tokenizer's EOS, read through a real TextStream with the route's stop strings and stop
    token ids, as the Launcher's astream reads them. scored(token, n, logprobs): the n-th token's
    logprob entries, where the request asks for logprobs."""
    from tests.test_tokenize_routes import scripted_server

    server = scripted_server(tokenizer, script)
    generated = script_ids(tokenizer, script) + [tokenizer.eos_token_id]

    def astream(prompt, sampling, max_new_tokens, logprobs=None, *, stop_token_ids=(), stop=(), ignore_eos=False,
                include_stop_str_in_output=False, skip_special_tokens=True, **options):
        ending = set(stop_token_ids) | (set() if ignore_eos else {tokenizer.eos_token_id})
        text = TextStream("r", tokenizer, tuple(stop), len(prompt), sampling.min_tokens, include_stop_str_in_output,
                          skip_special_tokens, tuple(sorted(ending)), prompt_ids=prompt)

        async def deltas():
            for n, token in enumerate(generated[:max_new_tokens], 1):
                finish = "stop" if token in ending else "length" if n == max_new_tokens else None
                entries = scored(token, n, logprobs) if scored is not None and logprobs is not None else None
                delta = text.delta(TokenEvent("r", [token], finish, entries))
                yield delta
                if delta.finish_reason is not None:
                    return

        return deltas()

    server.launcher.astream = astream
    return server


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 64}


@pytest.mark.parametrize("route, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
def test_the_routes_answer_the_stop_reason(smollm2_tokenizer, route, body):
    tok = smollm2_tokenizer
    comma = script_ids(tok, ",")[0]
    cases = [({"stop": ["city"]}, "city"), ({"stop_token_ids": [comma]}, comma), ({}, None),
             ({"stop": "Seine", "n": 2}, "Seine")]
    for fields, reason in cases:
        answer = run_route(text_stream_server(tok, SCRIPT), route, {**body, **fields})
        assert [(c["finish_reason"], c["stop_reason"]) for c in answer["choices"]] == \
            [("stop", reason)] * fields.get("n", 1), (route, fields)
        chunks = run_route(text_stream_server(tok, SCRIPT), route, {**body, **fields, "stream": True})
        ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
        assert [(e["finish_reason"], e["stop_reason"]) for e in ends] == [("stop", reason)] * fields.get("n", 1), \
            (route, fields)
        before = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
        if route == "/v1/chat/completions":
            assert all("stop_reason" not in choice for choice in before)
        else:  # every completions chunk carries it, null until the last (a client reads it from each)
            assert before and all(choice["stop_reason"] is None for choice in before)


def test_a_length_finish_has_a_null_stop_reason_on_the_route(smollm2_tokenizer):
    answer = run_route(text_stream_server(smollm2_tokenizer, SCRIPT), "/v1/completions",
                       {**COMPLETION, "max_tokens": 3, "stop": ["Seine"]})
    assert (answer["choices"][0]["finish_reason"], answer["choices"][0]["stop_reason"]) == ("length", None)


def test_without_a_tokenizer_the_configs_eos_is_the_plain_end():
    """A launch without a tokenizer named every ending id, its plain EOS too: Launcher passes
    config.json's first EOS as the plain end."""
    def ended_by(token: int):
        stream = TextStream("r", None, (), 3, stop_token_ids=(2, 7), eos_token_id=2)
        return stream.delta(TokenEvent("r", [token], "stop")).stop_reason

    assert ended_by(2) is None and ended_by(7) == 7
