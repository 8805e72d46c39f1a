"""Two refusals of the OpenAI server, in process (no Ray, no model): a client's names are not echoed
back whole in a 400, and a body with a Content-Encoding the server does not decode is refused with
415, before it is read, rather than parsed as JSON."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving.openai_protocol import ProtocolError


def refusal(model, body: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as refused:
        proto.parse_request(model, body)
    return refused.value


def wire_size(err: ProtocolError) -> int:
    return len(json.dumps(err.body()))


def test_an_unknown_parameter_name_is_not_echoed_whole():
    """{"k" * 500000: 1} got a 1,000,328-byte error body: the key in both `message` and `param`."""
    err = refusal(proto.CompletionRequest, {"model": "m", "prompt": "x", "k" * 500_000: 1})
    assert err.status == 400 and wire_size(err) < 2000
    assert "500000 characters" in err.message and err.param.startswith("k" * 200)
    assert len(err.param) < 250 and "500000 characters" in err.param
    short = refusal(proto.CompletionRequest, {"model": "m", "prompt": "x", "guided_json": {}})  # as before
    assert short.param == "guided_json" and "unknown parameter 'guided_json';" in short.message


def test_an_unknown_key_inside_an_object_field_is_not_echoed_whole():
    err = refusal(proto.CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"q" * 300_000: True}})
    assert wire_size(err) < 2000 and err.param.startswith("stream_options.qqq") and len(err.param) < 250
    assert "300015 characters" in err.message  # the path's length: "stream_options." and the key
    short = refusal(proto.CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"extra": 1}})
    assert short.param == "stream_options.extra" and "unknown parameter 'stream_options.extra';" in short.message


def chat_part(part: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [part]}]}


def test_a_content_part_type_is_not_echoed_whole():
    """A part with "type": "t" * 400000 got a 400 kB error body."""
    err = refusal(proto.ChatCompletionRequest, chat_part({"type": "t" * 400_000, "text": "x"}))
    assert err.status == 400 and wire_size(err) < 1000 and err.param == "messages.0.content.0"
    assert "content part type 'ttt" in err.message


def test_a_null_content_part_type_is_said_as_json_says_it():
    err = refusal(proto.ChatCompletionRequest, chat_part({"type": None, "text": "x"}))
    assert "content part type null is not supported" in err.message and "None" not in err.message
    err = refusal(proto.ChatCompletionRequest, chat_part({"type": "image_url", "image_url": {}}))
    assert "content part type 'image_url' is not supported" in err.message


# ---- Content-Encoding ---------------------------------------------------------------------------

def server_and_counts():
    """An OpenAIServer without Serve, counting into a list."""
    from launcher.serving.openai_app import BodyBudget, OpenAIServer

    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(ours)
    counted = []
    server.metrics = type("Counts", (), {"finished": lambda _, *a, **k: counted.append(("finished", *a)),
                                         "rejected": lambda _, *a, **k: counted.append(("rejected", *a))})()
    server.body_limit, server.bodies, server.name = 1 << 20, BodyBudget(1 << 26), "m"
    return server, counted


def post(body: bytes, encoding: str | None):
    """A POST of `body` with Content-Encoding `encoding`, and the list of body chunks the server read."""
    from starlette.requests import Request

    read = []

    async def receive():
        read.append(body)
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if encoding is not None:
        headers.append((b"content-encoding", encoding.encode()))
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                    "query_string": b""}, receive), read


BODY = json.dumps({"model": "m", "prompt": "Hello"}).encode()


@pytest.mark.parametrize("encoding, body", [("gzip", gzip.compress(BODY)), ("br", BODY), ("GZIP", BODY),
                                            ("identity, gzip", gzip.compress(BODY))],
                         ids=["gzip", "br-on-a-plain-body", "GZIP-on-a-plain-body", "identity-then-gzip"])
def test_an_encoded_body_gets_415_before_it_is_read_and_is_counted(encoding, body):
    """A gzip body got 400 "not valid JSON ...; send a JSON object with Content-Type: application/json",
    advice that could not help; the header on a plain body was ignored. No header, or identity, is
    read as before."""
    from launcher.serving import openai_app

    server, counted = server_and_counts()
    for plain in (None, "identity", "Identity"):
        request, read = post(BODY, plain)
        assert asyncio.run(server._request(proto.CompletionRequest, request)).prompt == "Hello"
        assert read == [BODY] and counted == []
    request, read = post(body, encoding)
    with pytest.raises(ProtocolError) as refused:
        asyncio.run(server._request(proto.CompletionRequest, request))
    err = refused.value
    assert err.status == 415 and err.code == "unsupported_content_encoding"
    assert encoding.split(", ")[-1] in err.message and "uncompressed" in err.message
    assert "Content-Encoding" in err.message and "not valid JSON" not in err.message
    assert read == [] and server.bodies.used == 0  # refused on its headers, its body left unread
    assert counted == [("rejected", 415)]  # as every other refused request
    answer = asyncio.run(openai_app.app.exception_handlers[ProtocolError](request, err))
    assert answer.status_code == 415
    assert set(json.loads(answer.body)["error"]) == {"message", "type", "param", "code"}


def test_a_long_content_encoding_is_not_echoed_whole():
    server, counted = server_and_counts()
    request, _ = post(BODY, "x" * 5000)
    with pytest.raises(ProtocolError) as refused:
        asyncio.run(server._request(proto.CompletionRequest, request))
    assert refused.value.status == 415 and wire_size(refused.value) < 1000
