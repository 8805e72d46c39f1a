"""SageMaker's routes, as vLLM serves them (launcher/serving/openai_app.py): POST /invocations answered
by the route its body's kind names (messages: chat, prompt: completions, input: responses), whole and
streamed, the API key as on /v1; a body of no kind refused naming the keys; a body that is no JSON
refused by the chat route in its words; GET and POST /ping answering as /health. In-process over
SmolLM2's tokenizer and a scripted engine (tests/test_responses_route.py's)."""

from __future__ import annotations

import asyncio
import json

import pytest

from launcher.serving.openai_protocol import ProtocolError
from tests.test_responses_route import server_over
from tests.test_tokenize_routes import post, streamed_text_of

MODEL = "smollm2-135m-instruct"
SCRIPT = "The sky is blue."


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    return tokenizer


def invoked(server, body, key: str | None = None):
    """(status, the JSON answer or the stream's text) of POST /invocations."""
    async def run():
        response = await server.invocations(post("/invocations", body, key))
        if not isinstance(body, dict) or not body.get("stream"):
            return response.status_code, json.loads(response.body)
        return response.status_code, await streamed_text_of(response)

    return asyncio.run(run())


def test_each_kind_of_body_is_answered_by_its_route(tokenizer):
    status, chat = invoked(server_over(tokenizer, SCRIPT), {"model": MODEL, "messages": [{"role": "user", "content": "Sky?"}]})
    assert status == 200 and chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == SCRIPT
    status, text = invoked(server_over(tokenizer, SCRIPT), {"model": MODEL, "prompt": "Sky?", "max_tokens": 10})
    assert status == 200 and text["object"] == "text_completion" and text["choices"][0]["text"] == SCRIPT
    status, response = invoked(server_over(tokenizer, SCRIPT), {"model": MODEL, "input": "Sky?"})
    assert status == 200 and response["object"] == "response" and response["output"][0]["content"][0]["text"] == SCRIPT


def test_a_streamed_invocation_streams_as_its_route_does(tokenizer):
    status, text = invoked(server_over(tokenizer, SCRIPT), {"model": MODEL, "stream": True,
                                                             "messages": [{"role": "user", "content": "Sky?"}]})
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == SCRIPT


def test_a_body_of_no_kind_is_refused_naming_the_keys(tokenizer):
    server = server_over(tokenizer, SCRIPT)
    with pytest.raises(ProtocolError) as refused:
        invoked(server, {"model": MODEL, "text": "Sky?"})
    assert refused.value.status == 400 and all(key in refused.value.message for key in ("messages", "prompt", "input"))
    with pytest.raises(ProtocolError) as refused:  # no JSON object: the chat route's own refusal
        invoked(server, ["not", "an", "object"])
    assert refused.value.status == 400 and "JSON object" in refused.value.message


def test_the_api_key_guards_invocations_as_it_guards_v1(tokenizer):
    server = server_over(tokenizer, SCRIPT)
    server.api_key = "sk-test"
    body = {"model": MODEL, "prompt": "Sky?", "max_tokens": 10}
    with pytest.raises(ProtocolError) as refused:
        invoked(server, body)
    assert refused.value.status == 401
    assert invoked(server, body, key="sk-test")[0] == 200


def test_ping_answers_as_health(tokenizer):
    from types import SimpleNamespace

    server = server_over(tokenizer, SCRIPT)
    for state, status in (("serving", 200), ("failed", 503)):
        server.launcher = SimpleNamespace(replica_status=lambda state=state: [{"state": state}], shutdown=lambda: None)
        assert server.ping().status_code == status == server.health().status_code
        assert json.loads(server.ping().body) == json.loads(server.health().body)


def test_the_replayed_request_hands_its_body_over_once_then_what_the_client_sends():
    """The route /invocations hands a body to reads it as its own; after it, the client's own messages
    (its disconnect) arrive; the bytes are not held once handed over."""
    from starlette.requests import Request

    from launcher.serving.openai_app import _replayed

    async def client_receive():
        return {"type": "http.disconnect"}

    original = Request({"type": "http", "method": "POST", "path": "/invocations", "headers": [],
                        "query_string": b""}, client_receive)
    replayed = _replayed(original, b'{"prompt": "Hi"}')

    async def both():
        return await replayed.receive(), await replayed.receive()

    first, then = asyncio.run(both())
    assert first == {"type": "http.request", "body": b'{"prompt": "Hi"}', "more_body": False}
    assert then == {"type": "http.disconnect"}
    cells = [cell.cell_contents for cell in replayed.receive.__closure__ if isinstance(cell.cell_contents, list)]
    assert cells == [[]]  # the body is not held once handed over


def test_a_body_with_two_kinds_goes_to_the_first_key_in_order(tokenizer):
    """messages before prompt before input, as the route list is ordered; the chosen route's parser
    then refuses the other kind's key by name (this server's parsers take no unknown field)."""
    server = server_over(tokenizer, SCRIPT)
    with pytest.raises(ProtocolError) as refused:
        invoked(server, {"model": MODEL, "prompt": "Sky?", "messages": [{"role": "user", "content": "Sky?"}]})
    assert refused.value.param == "prompt"  # the chat route's refusal
