"""Refusals and log-probabilities that must survive being written as JSON: a lone surrogate ("\\ud800",
which JSON can carry and UTF-8 cannot) quoted in a 400's message or param; a -inf log-probability;
two alternatives that read the same. Also best_of below n, which vLLM and OpenAI refuse.

The HTTP tests run the server's real FastAPI app (its routes, exception handlers and Starlette's
JSONResponse) in process, its replica a scripted one over SmolLM2's real tokenizer
(tests/test_tokenize_routes.py's scripted_server)."""

from __future__ import annotations

import inspect
import json
import math
from types import SimpleNamespace

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving import responses
from launcher.serving.openai_protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError,
                                              parse_request)
from launcher.serving.token_pieces import TokenPieces
from tests.test_tokenize_routes import MODEL, scripted_server
from workers.serving.requests import TokenLogprob

SURROGATE = "\ud800"
ESCAPED = "\\ud800"  # as the error quotes it: a backslash and "ud800", which UTF-8 encodes
TEXT_PART_WITH_A_SURROGATE_KEY = {"model": MODEL, "messages": [
    {"role": "user", "content": [{"type": "text", "text": "x", SURROGATE: 1}]}]}
PART_KEY_PARAM = f"messages.0.content.0.{ESCAPED}"


def raw_json(body: dict) -> bytes:
    """`body` as a client sends it: the surrogate as the JSON escape \\ud800 (json.dumps writes it so)."""
    return json.dumps(body).encode("ascii")


@pytest.fixture
def client(smollm2_tokenizer):
    """A Starlette TestClient over the server's real app, its routes answered by a scripted replica
    (Serve would hand them the replica; here FastAPI's dependency override does)."""
    from fastapi.testclient import TestClient
    from ray.serve._private.http_util import _walk_fastapi_routes

    from launcher.serving.openai_app import app

    route = next(r for r, _, _ in _walk_fastapi_routes(app) if getattr(r, "path", None) == "/v1/chat/completions")
    replica_of_the_request = inspect.signature(route.endpoint).parameters["self"].default.dependency
    app.dependency_overrides[replica_of_the_request] = lambda: scripted_server(smollm2_tokenizer, "Paris.")
    try:
        with TestClient(app, raise_server_exceptions=False) as test_client:  # a 500 comes back as the client sees it
            yield test_client
    finally:
        app.dependency_overrides.pop(replica_of_the_request, None)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", TEXT_PART_WITH_A_SURROGATE_KEY, PART_KEY_PARAM),
    ("/tokenize", TEXT_PART_WITH_A_SURROGATE_KEY, PART_KEY_PARAM),
    ("/invocations", TEXT_PART_WITH_A_SURROGATE_KEY, PART_KEY_PARAM),
    ("/v1/responses", {"model": MODEL, "input": "hi", SURROGATE: 1}, ESCAPED),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "hi", SURROGATE: 1}]},
     f"input[0].{ESCAPED}"),
])
def test_a_lone_surrogate_in_an_unknown_key_is_a_json_400_naming_it_escaped(client, route, body, param):
    # the 400 was built, then writing it as UTF-8 failed: a plain-text 500 and a traceback
    answer = client.post(route, content=raw_json(body), headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert ESCAPED in error["message"]


def test_the_server_still_answers_a_valid_chat_beside_it(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Paris."


def _refusal(parse) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse()
    return caught.value


CHAT_REFUSALS = {  # each quotes the client's surrogate in its message, its param, or both
    "text part key": TEXT_PART_WITH_A_SURROGATE_KEY,
}
RESPONSES_REFUSALS = {
    "top-level key": {"model": MODEL, "input": "hi", SURROGATE: 1},
    "item key": {"model": MODEL, "input": [{"role": "user", "content": "hi", SURROGATE: 1}]},
    "part key": {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi", SURROGATE: 1}]}]},
    "tool_choice key": {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f"}],
                        "tool_choice": {"type": "function", "name": "f", SURROGATE: 1}},
    "text key": {"model": MODEL, "input": "hi", "text": {SURROGATE: 1}},
    "reasoning key": {"model": MODEL, "input": "hi", "reasoning": {SURROGATE: 1}},
    "tool key": {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f", SURROGATE: 1}]},
}


def _refusals() -> list[ProtocolError]:
    chat = [_refusal(lambda body=body: parse_request(ChatCompletionRequest, body).messages[0].text())
            for body in CHAT_REFUSALS.values()]
    answers = [_refusal(lambda body=body: responses.chat_body(body, None, keeping=False))
               for body in RESPONSES_REFUSALS.values()]
    built = [ProtocolError(f"quoted {SURROGATE}", param=f"a.{SURROGATE}"),  # any raise site, present or future
             ProtocolError(f"prompt[0]: {SURROGATE}", f"prompt.{SURROGATE}", 503, "server_error", None)]
    return chat + answers + built


def test_every_refusal_quoting_a_lone_surrogate_encodes_as_utf8_json_and_as_an_sse_error_event():
    refusals = _refusals()
    assert len(refusals) == len(CHAT_REFUSALS) + len(RESPONSES_REFUSALS) + 2
    for err in refusals:
        body = err.body()
        text = json.dumps(body, ensure_ascii=False)  # as Starlette's JSONResponse renders it
        text.encode("utf-8")  # raised UnicodeEncodeError
        proto.sse_event(body).encode("utf-8")  # a stream's error event
        assert SURROGATE not in text and ESCAPED in text, body
        assert SURROGATE not in str(err) and (err.param is None or SURROGATE not in err.param)


def test_error_body_built_directly_encodes_too_and_valid_text_is_left_as_it_is():
    body = proto.error_body(f"generation failed: {SURROGATE}", param=SURROGATE, type="server_error")
    assert json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert body["error"]["message"] == f"generation failed: {ESCAPED}" and body["error"]["param"] == ESCAPED
    kept = ProtocolError("model 'café-日本' does not exist", param="model.é")
    assert kept.message == "model 'café-日本' does not exist" and kept.param == "model.é"
    assert ProtocolError("no param").param is None


# ---- best_of ----------------------------------------------------------------------------------
def test_best_of_below_n_is_refused_naming_both_as_vllm_and_openai_do():
    err = _refusal(lambda: parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", "best_of": 1, "n": 2}))
    assert err.status == 400 and err.param == "best_of"
    assert "best_of (1)" in err.message and "n (2)" in err.message and "leave best_of out" in err.message


@pytest.mark.parametrize("body", [
    {"n": 2},  # best_of left out: it is n (vLLM's default), not 1
    {"n": 2, "best_of": None},  # null is left out
    {"n": 1, "best_of": 1},
    {"best_of": 1},
])
def test_best_of_left_out_or_at_least_n_is_taken(body):
    request = parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", **body})
    assert request.n == body.get("n", 1)


# ---- log-probabilities ------------------------------------------------------------------------
def pieces_of(words: dict[int, str]) -> TokenPieces:
    """TokenPieces over a vocabulary of `words`, where ids may read the same (a SentencePiece vocabulary
    has "x" and "▁x"-less spellings that do; SmolLM2's has none, so this is a tokenizer of its own)."""
    def decode(ids, skip_special_tokens=False, **options):
        return "".join(words[i] for i in ids)

    return TokenPieces(SimpleNamespace(decode=decode))


def test_two_alternatives_that_read_the_same_keep_the_more_likely_logprob():
    pieces = pieces_of({1: "x", 2: "x", 3: "y"})
    entry = TokenLogprob(3, -3.0, [(1, -0.1), (2, -2.0), (3, -3.0)])  # most likely first
    listed = proto.completion_logprobs([(entry, 0)], pieces)["top_logprobs"][0]
    assert listed == {"x": -0.1, "y": -3.0}  # "x" was -2.0: the least likely of the two overwrote it
    assert max(listed, key=listed.get) == "x"  # lm-evaluation-harness's is_greedy reads this


def strict_json(event: str):
    """An SSE event's JSON, refusing -Infinity, Infinity and NaN, as every non-Python JSON parser does."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(event.removeprefix("data: "), parse_constant=refuse)


def test_a_minus_infinity_logprob_is_reported_at_vllms_floor_on_every_logprobs_object():
    pieces = pieces_of({1: "a", 2: "b", 3: "c"})
    masked = TokenLogprob(1, -math.inf, [(2, -0.5), (3, -math.inf)], rank=3)  # a token the rules masked out
    completion = strict_json(proto.sse_event(proto.completion_logprobs([(masked, 0)], pieces)))
    assert completion["token_logprobs"] == [-9999.0] and completion["top_logprobs"] == [{"b": -0.5, "c": -9999.0,
                                                                                         "a": -9999.0}]
    chat = strict_json(proto.sse_event(proto.chat_logprobs([masked], pieces)))["content"][0]
    assert chat["logprob"] == -9999.0 and [t["logprob"] for t in chat["top_logprobs"]] == [-0.5, -9999.0]
    prompt = strict_json(proto.sse_event({"p": proto.vllm_prompt_logprobs([masked], pieces, 2)}))["p"]
    assert prompt[1]["1"]["logprob"] == -9999.0 and prompt[1]["3"]["logprob"] == -9999.0
    assert prompt[1]["2"]["logprob"] == -0.5  # a finite one is left as it is
