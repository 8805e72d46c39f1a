"""vLLM's skip_special_tokens (default true): false keeps the special tokens the model generates
(SmolLM2's `<|im_end|>`) in the text, where stop strings are looked for too; token ids, usage,
logprobs' token strings and an echoed prompt are the same either way. Checked on the text stream
with SmolLM2's real tokenizer, on the request bodies, through the driver API and on both HTTP routes
(a replica over a real in-process Launcher: a small random model with SmolLM2's vocabulary and
tokenizer, made to generate the special token by allowed_token_ids)."""

from __future__ import annotations

import asyncio
import json

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request
from launcher.serving.text_stream import TextStream
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_request_bodies import assert_refused_unless_bool
from workers.serving.requests import TokenEvent

END = "<|im_end|>"
NEW = 3


def end_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(END)


def streamed(tokenizer, ids: list[int], stops: tuple[str, ...] = (), **options):
    """The text, finish reason and per-delta token ids of `ids` pushed one event per token."""
    stream = TextStream("r", tokenizer, stops, prompt_tokens=1, **options)
    deltas = [stream.delta(TokenEvent("r", [token], "length" if i == len(ids) - 1 else None))
              for i, token in enumerate(ids)]
    ended = next(d for d in deltas if d.finish_reason is not None)
    return "".join(d.text for d in deltas), ended.finish_reason, [t for d in deltas for t in d.token_ids]


# ---- the text stream -------------------------------------------------------------------------------
def test_special_tokens_in_the_middle_and_at_the_end_are_in_the_text_only_when_not_skipped(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello") + [end_id(tok)] + tok.encode(" world") + [end_id(tok)]
    skipped, kept, default = (streamed(tok, ids, skip_special_tokens=True),
                              streamed(tok, ids, skip_special_tokens=False), streamed(tok, ids))
    assert skipped[0] == default[0] == "Hello world"
    assert kept[0] == f"Hello{END} world{END}" == tok.decode(ids, skip_special_tokens=False)
    assert skipped[2] == kept[2] == ids and skipped[1] == kept[1] == "length"  # the tokens are the same


def test_a_special_stop_token_that_ends_the_request_keeps_its_text_out(smollm2_tokenizer):
    """An EOS (or a special stop token id) that ends the request is not shown even when special tokens
    are kept, as vLLM leaves a stop token's text out; include_stop_str_in_output shows it. The same
    token in the middle is shown."""
    tok = smollm2_tokenizer
    ids = tok.encode("Hello") + [end_id(tok)] + tok.encode(" world") + [end_id(tok)]

    def ended_by_stop_token(**options):
        stream = TextStream("r", tok, (), prompt_tokens=1, stop_token_ids=(end_id(tok),), **options)
        return "".join(stream.delta(TokenEvent("r", [token], "stop" if i == len(ids) - 1 else None)).text
                       for i, token in enumerate(ids))

    assert ended_by_stop_token(skip_special_tokens=False) == f"Hello{END} world"
    assert ended_by_stop_token(skip_special_tokens=False, include_stop_str_in_output=True) == f"Hello{END} world{END}"
    assert ended_by_stop_token() == "Hello world"


def test_a_stop_string_holding_a_special_tokens_text_matches_only_when_it_is_in_the_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello") + [end_id(tok)] + tok.encode(" world and more")
    stop = (f"{END} world",)
    assert streamed(tok, ids, stop, skip_special_tokens=False)[:2] == ("Hello", "stop")
    assert streamed(tok, ids, stop, skip_special_tokens=False, include_stop_str_in_output=True)[:2] == (
        f"Hello{END} world", "stop")
    assert streamed(tok, ids, stop)[:2] == ("Hello world and more", "length")  # skipped: nothing to match


def test_logprobs_text_offsets_count_the_special_tokens_text_that_is_kept(smollm2_tokenizer):
    """Completions' text_offset points into the text as sent: a kept special token's text counts (the
    offsets' own decoding skipped it: ' there' was placed at 2, not 12), and a stop string's token
    carries no logprobs entry after the stop (it kept one)."""
    from launcher.serving import openai_protocol as proto
    from launcher.serving.openai_render import CompletionRender
    from launcher.serving.token_pieces import TokenPieces
    from workers.serving.requests import TokenLogprob

    tok = smollm2_tokenizer
    ids = tok.encode("Hi") + [end_id(tok)] + tok.encode(" there friend")
    stream = TextStream("r", tok, (" friend",), 1, skip_special_tokens=False)
    render = CompletionRender(TokenPieces(tok), True, skip_special_tokens=False)
    meta = proto.ResponseMeta.new("cmpl", "m")
    sent, placed = "", []
    for k, token in enumerate(ids):
        delta = stream.delta(TokenEvent("r", [token], "length" if k == len(ids) - 1 else None,
                                        [TokenLogprob(token, -1.0, [])]))
        chunk = render.chunk(meta, delta)
        if chunk:
            choice = chunk["choices"][0]
            sent += choice["text"]
            if choice["logprobs"]:
                placed += list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]))
        if delta.finish_reason:
            break
    assert sent == f"Hi{END} there"
    assert all(sent.startswith(token, offset) for token, offset in placed)
    assert (" there", len(f"Hi{END}")) in placed and not any(token == " friend" for token, _ in placed)


# ---- the request bodies ----------------------------------------------------------------------------
BASES = {"completions": (CompletionRequest, {"model": "m", "prompt": "hi"}),
         "chat": (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})}


@pytest.mark.parametrize("endpoint", BASES)
def test_skip_special_tokens_is_taken_as_a_bool_defaulting_to_true_and_refused_otherwise_by_name(endpoint):
    model, base = BASES[endpoint]
    assert parse_request(model, base).skip_special_tokens is True
    assert parse_request(model, {**base, "skip_special_tokens": None}).skip_special_tokens is True
    assert parse_request(model, {**base, "skip_special_tokens": False}).skip_special_tokens is False
    assert_refused_unless_bool(model, base, "skip_special_tokens",
                               (("false", "'false'"), (0, "0"), ([False], "[false]")))


# ---- the driver API and the HTTP routes, over a real in-process Launcher ---------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("skip"))


def forced(tokenizer) -> dict:
    """Sampling that can only generate `<|im_end|>`, and generation that does not end on it."""
    from shardlib.sampling_params import SamplingParams

    return dict(sampling=SamplingParams(temperature=0.0, allowed_token_ids=[end_id(tokenizer)]), ignore_eos=True,
                max_new_tokens=NEW)


def test_the_driver_streams_keep_special_tokens_when_asked_and_refuse_a_non_bool(model_dir, in_process_cluster):
    from launcher.api import Launcher

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        kept = list(llm.stream("Hi", skip_special_tokens=False, **forced(llm.tokenizer)))
        skipped = list(llm.stream("Hi", **forced(llm.tokenizer)))

        async def read(**options):
            return [d async for d in llm.astream("Hi", **forced(llm.tokenizer), **options)]

        kept_async = asyncio.run(read(skip_special_tokens=False))
        for call in (llm.stream, llm.astream):
            with pytest.raises(ValueError, match=r"^skip_special_tokens \('no'\) must be True or False$"):
                call("Hi", skip_special_tokens="no")
        assert llm.load() == {"running": 0, "waiting": 0}  # nothing refused was submitted
        ids = [end_id(llm.tokenizer)] * NEW
    for deltas, text in ((kept, END * NEW), (kept_async, END * NEW), (skipped, "")):
        assert "".join(d.text for d in deltas) == text
        assert [t for d in deltas for t in d.token_ids] == ids


def replica_over(llm):
    """The server's class over a real Launcher, its fields set as its constructor sets them."""
    from launcher.serving.metrics import ServerMetrics
    from launcher.serving.openai_app import _context_tokens
    from launcher.serving.token_pieces import TokenPieces
    from tests.test_tokenize_routes import replica

    server = replica(llm.tokenizer, context=_context_tokens(llm))
    server.launcher, server.pieces, server.metrics = llm, TokenPieces(llm.tokenizer), ServerMetrics(llm.load)
    server.longest_prompt, server.several_replicas = None, False
    return server


async def answered(server, route: str, body: dict):
    """The route's JSON answer, or its server-sent events' objects when streamed."""
    from tests.test_tokenize_routes import post, streamed_text_of

    response = await getattr(server, route.strip("/").replace("v1/", "").replace("/", "_"))(post(route, body))
    assert response.status_code == 200
    if not body.get("stream"):
        return json.loads(response.body)
    text = await streamed_text_of(response)
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def answered_both_ways(server, route: str, stream: bool, fields: dict, changed: dict) -> tuple[dict, object, object]:
    """(the body, its answer, the answer with `changed` fields): two choices of "Hi" (completions) or
    of one user message saying it (chat), streamed with usage when `stream`, plus `fields`."""
    asked = {"model": "smollm2-135m-instruct", "n": 2, "stream": stream, **fields}
    asked.update({"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    if stream:
        asked["stream_options"] = {"include_usage": True}

    async def both():
        return await answered(server, route, asked), await answered(server, route, {**asked, **changed})

    return (asked, *asyncio.run(both()))


def choice_texts(route: str, answer, n: int) -> list[str]:
    key = "text" if route == "/v1/completions" else "content"
    if isinstance(answer, dict):
        return [c["text"] if key == "text" else c["message"]["content"] for c in answer["choices"]]
    texts = [""] * n
    for chunk in answer:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"] if key == "text" else c["delta"].get("content", "")
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_both_routes_keep_special_tokens_in_every_choices_text_only_when_asked(model_dir, in_process_cluster,
                                                                              route, stream):
    from launcher.api import Launcher

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)
        fields = {"max_tokens": NEW, "temperature": 0, "allowed_token_ids": [end_id(llm.tokenizer)], "ignore_eos": True,
                  **({"logprobs": 1} if route == "/v1/completions" else {"logprobs": True, "top_logprobs": 1})}
        asked, skipped, kept = answered_both_ways(server, route, stream, fields, {"skip_special_tokens": False})
        if route == "/v1/completions" and not stream:  # an echoed prompt keeps its special tokens either way
            prompt = llm.tokenizer.encode("Hi") + [llm.tokenizer.convert_tokens_to_ids("<|im_start|>")]
            echoed = {**asked, "prompt": prompt, "echo": True, "n": 1}
            echoes = [asyncio.run(answered(server, route, {**echoed, "skip_special_tokens": skip}))
                      for skip in (True, False)]
            assert [choice_texts(route, e, 1) for e in echoes] == [["Hi<|im_start|>"], [f"Hi<|im_start|>{END * NEW}"]]
    assert choice_texts(route, skipped, 2) == ["", ""]
    assert choice_texts(route, kept, 2) == [END * NEW] * 2
    usage = [a if isinstance(a, dict) else a[-1] for a in (skipped, kept)]
    assert [u["usage"]["completion_tokens"] for u in usage] == [2 * NEW, 2 * NEW]
    if not stream:  # the logprobs' token strings are the tokens' own, whatever the text skips
        for answer in (skipped, kept):
            for choice in answer["choices"]:
                tokens = (choice["logprobs"]["tokens"] if route == "/v1/completions" else
                          [t["token"] for t in choice["logprobs"]["content"]])
                assert tokens == [END] * NEW
