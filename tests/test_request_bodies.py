"""How the OpenAI server reads request bodies (launcher/serving/openai_app._read_body): a budget for
the large bodies read at once, and a deadline for a body's arrival. Driven through Starlette's own
Request over an ASGI receive channel that hands the body over in chunks."""

from __future__ import annotations

import asyncio
import time

import pytest

from launcher.serving import openai_app
from launcher.serving.openai_app import PARSED_ON_A_THREAD, BodyBudget, _read_body
from launcher.serving.openai_protocol import ProtocolError, parse_request

LARGE = 3 * PARSED_ON_A_THREAD


def request_of(chunks: list[bytes], declared: bool = True, hold: asyncio.Event | None = None):
    """A POST whose body arrives as `chunks`; with `hold`, the last chunk waits for it."""
    from starlette.requests import Request

    pending = list(chunks)

    async def receive():
        if hold is not None and len(pending) == 1:
            await hold.wait()
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    headers = [(b"content-type", b"application/json")]
    if declared:
        headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                    "query_string": b""}, receive)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_large_bodies_past_the_budget_get_503_and_the_budget_comes_back(declared):
    """250 clients each holding a 5 MB body unfinished took the replica from 1.1 to 2.0 GB."""
    async def run():
        budget = BodyBudget(LARGE + LARGE // 2)
        hold = asyncio.Event()
        first = asyncio.create_task(_read_body(request_of([b"a" * LARGE, b"b"], declared, hold), 10 * LARGE, budget))
        await asyncio.sleep(0.05)  # the first body is on its way, its last byte held back
        with pytest.raises(ProtocolError) as refused:
            await _read_body(request_of([b"c" * LARGE, b"d"], declared), 10 * LARGE, budget)
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert refused.value.body()["error"]["code"] == "server_busy"
        hold.set()
        body, held = await first
        assert body == b"a" * LARGE + b"b" and budget.used == held == LARGE + 1  # held until it is parsed
        budget.give(held)  # as the server does once parsed: the next large body is read
        assert await _read_body(request_of([b"e" * LARGE]), 10 * LARGE, budget) == (b"e" * LARGE, LARGE)

    asyncio.run(run())


def test_small_bodies_are_read_whatever_the_budget():
    async def run():
        budget = BodyBudget(0)
        assert await _read_body(request_of([b"x" * 1000]), 10 * LARGE, budget) == (b"x" * 1000, 0)
        assert await _read_body(request_of([b"y" * 1000], declared=False), 10 * LARGE, budget) == (b"y" * 1000, 0)

    asyncio.run(run())


def test_a_body_that_does_not_arrive_in_time_gets_408(monkeypatch):
    monkeypatch.setattr(openai_app, "BODY_READ_S", 0.2)

    async def run():
        budget = BodyBudget(10 * LARGE)
        with pytest.raises(ProtocolError) as late:
            await _read_body(request_of([b"a" * LARGE, b"b"], hold=asyncio.Event()), 10 * LARGE, budget)
        assert late.value.status == 408 and "did not arrive within 0.2 s" in late.value.message
        assert budget.used == 0

    asyncio.run(run())


def test_a_small_body_has_a_shorter_deadline_than_a_large_one(monkeypatch):
    """Every body had 60 s: 16 connections each sending half a small body held every place Serve lets
    through to a replica, and /health and /metrics waited behind them for a minute. A large body
    (declared, or a chunked one once it grows past PARSED_ON_A_THREAD) keeps the long deadline."""
    monkeypatch.setattr(openai_app, "SMALL_BODY_READ_S", 0.2)
    monkeypatch.setattr(openai_app, "BODY_READ_S", 0.6)

    async def late(chunks, declared, wait_s):
        hold = asyncio.Event()
        asyncio.get_running_loop().call_later(wait_s, hold.set)
        return await _read_body(request_of(chunks, declared, hold), 10 * LARGE, BodyBudget(10 * LARGE))

    async def run():
        with pytest.raises(ProtocolError, match="did not arrive within 0.2 s"):
            await late([b"{", b"}"], True, 0.4)
        assert (await late([b"a" * LARGE, b"b"], True, 0.4))[0] == b"a" * LARGE + b"b"  # large: 0.6 s
        assert (await late([b"a" * LARGE, b"b"], False, 0.4))[0] == b"a" * LARGE + b"b"  # chunked, grown large
        with pytest.raises(ProtocolError, match="did not arrive within 0.6 s"):
            await late([b"a" * LARGE, b"b"], False, 0.8)

    asyncio.run(run())


def test_the_size_limit_still_answers_413_first():
    async def run():
        with pytest.raises(ProtocolError) as big:
            await _read_body(request_of([b"a" * LARGE]), LARGE - 1, BodyBudget(0))
        assert big.value.status == 413

    asyncio.run(run())


def test_a_client_gone_while_its_body_is_read_is_an_abort_without_a_traceback():
    """A client that closed its connection part-way through its body raised Starlette's
    ClientDisconnect out of the route: a 65-line traceback in the replica's log per client, and no
    count in /metrics, where every other client that leaves is an abort (499)."""
    from starlette.requests import ClientDisconnect, Request

    from launcher.serving import openai_protocol as proto
    from launcher.serving.openai_app import OpenAIServer

    sent = [{"type": "http.request", "body": b'{"model":', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return sent.pop(0)

    wrapper = OpenAIServer.func_or_class  # Serve's ingress subclass; ours is the class it wraps
    ours = next(c for c in wrapper.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(ours)
    counted = []
    server.metrics = type("Counts", (), {"finished": lambda _, *a: counted.append(("finished", *a)),
                                         "rejected": lambda _, *a: counted.append(("rejected", *a))})()
    server.body_limit, server.bodies = 10 * LARGE, BodyBudget(10 * LARGE)
    def post(length: int, receive) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                        "headers": [(b"content-length", str(length).encode())]}, receive)

    request = post(100, receive)
    with pytest.raises(ClientDisconnect):
        asyncio.run(server._request(proto.CompletionRequest, request))
    assert counted == [("finished", "abort", 499)] and server.bodies.used == 0
    handled = asyncio.run(openai_app.app.exception_handlers[ClientDisconnect](request, ClientDisconnect()))
    assert handled.status_code == 499  # answered quietly: the app's handler, not Serve's traceback

    # the other way a client's leaving shows: Serve cancels the request while its body is awaited
    async def never():
        await asyncio.Event().wait()

    async def cancelled_after(delay_s: float, length: int, receive):
        """The request read by the server, cancelled (as Serve does when its client leaves) after delay_s."""
        task = asyncio.create_task(server._request(proto.CompletionRequest, post(length, receive)))
        await asyncio.sleep(delay_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    counted.clear()
    asyncio.run(cancelled_after(0.05, 100, never))
    assert counted == [("finished", "abort", 499)] and server.bodies.used == 0

    # behind Serve's proxy (--replicas 2): the proxy cancels the request and its receive raises Ray's
    # TaskCancelledError, which was neither counted nor handled (the traceback again)
    from ray.exceptions import TaskCancelledError

    async def proxy_cancels():
        raise TaskCancelledError()

    counted.clear()
    behind_proxy = post(100, proxy_cancels)
    with pytest.raises(TaskCancelledError):
        asyncio.run(server._request(proto.CompletionRequest, behind_proxy))
    assert counted == [("finished", "abort", 499)] and server.bodies.used == 0
    handled = asyncio.run(openai_app.app.exception_handlers[TaskCancelledError](behind_proxy, TaskCancelledError()))
    assert handled.status_code == 499

    # gone while a large body is parsed on a thread: outside the counted read, it went uncounted
    body = b'{"model": "m", "prompt": [' + b"1, " * (LARGE // 3) + b'1]}'
    arrived = [{"type": "http.request", "body": body, "more_body": False}]

    async def whole():
        return arrived.pop(0)

    def slow_parse(model, parsed):
        time.sleep(0.3)
        return parsed

    server._parse = slow_parse

    counted.clear()
    asyncio.run(cancelled_after(0.1, len(body), whole))
    assert counted == [("finished", "abort", 499)] and server.bodies.used == 0


def test_the_marker_code_points_sanitizing_drops_are_not_measured_in_a_chat(smollm2_tokenizer):
    """U+F0000 and U+F0001 are dropped from message text when it is tokenized, but the length check
    measured them (several byte tokens each): 9000 of them and "Hi", a 31-token prompt, were refused as
    'its first 8192 characters alone have 32332 tokens'."""
    import threading

    from launcher.serving.openai_app import OpenAIServer, _marks_chat_inputs, _sanitizing
    from launcher.serving.prompt_probe import longest_token_chars

    wrapper = OpenAIServer.func_or_class
    ours = next(c for c in wrapper.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(ours)
    server.tokenizer, server.name, server._encoding = smollm2_tokenizer, "m", threading.Lock()
    server.context_tokens, server._longest_token = 512, longest_token_chars(smollm2_tokenizer)
    server._chat_options = _sanitizing(smollm2_tokenizer)
    server._marks_chat_inputs = bool(server._chat_options) and _marks_chat_inputs(smollm2_tokenizer)
    if not server._chat_options:
        pytest.skip("this transformers does not sanitize chat messages")
    plain = server._apply_chat_template([{"role": "user", "content": "Hi"}])
    marked = server._apply_chat_template([{"role": "user", "content": "\U000f0000" * 9000 + "Hi"}])
    assert marked == plain and len(plain) < 64


# ---- include_stop_str_in_output (vLLM's extension), as both routes parse it ---------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_stop_str_in_output_is_taken_as_a_bool_and_refused_otherwise_by_name(endpoint):
    from launcher.serving.openai_protocol import ChatCompletionRequest, CompletionRequest

    model, base = ((CompletionRequest, {"model": "m", "prompt": "hi"}) if endpoint == "completions" else
                   (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert parse_request(model, {**base, "include_stop_str_in_output": True}).include_stop_str_in_output is True
    assert parse_request(model, base).include_stop_str_in_output is False
    assert parse_request(model, {**base, "include_stop_str_in_output": None}).include_stop_str_in_output is False
    assert_refused_unless_bool(model, base, "include_stop_str_in_output",
                               (("true", "'true'"), (1, "1"), ([True], "[true]")))


def assert_refused_unless_bool(model, base: dict, field: str, bads) -> None:
    """Each (value, as the message shows it) of `bads` for `field` is a 400 naming the field."""
    for bad, shown in bads:
        with pytest.raises(ProtocolError) as caught:
            parse_request(model, {**base, field: bad})
        err = caught.value
        assert err.status == 400 and err.param == field
        assert err.message.startswith(f"{field} ({shown}) must be true or false"), err.message
