"""A client that leaves while its structured output's grammar is checked (llguidance compiling a large
schema off the event loop takes seconds) is counted as an abort, 499, as one that leaves at every
other step before its stream: it was counted nowhere in corelaunch_requests_total, which counts each
request once. In-process over SmolLM2's tokenizer and a scripted engine (tests/test_tokenize_routes.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_tokenize_routes import MODEL, post, scripted_server

STRUCTURED = {"model": MODEL, "messages": [{"role": "user", "content": "JSON?"}], "max_tokens": 4,
              "response_format": {"type": "json_object"}}


def counted_requests(server) -> dict[str, float]:
    """corelaunch_requests_total's series that counted something, by their labels."""
    rows = [row for row in server.metrics.render().decode().splitlines()
            if row.startswith("corelaunch_requests_total{")]
    return {row.split("{")[1].split("}")[0]: float(row.split()[-1]) for row in rows if float(row.split()[-1])}


def test_a_client_gone_during_the_grammar_check_is_counted_as_an_abort(smollm2_tokenizer):
    server = scripted_server(smollm2_tokenizer, "{}")
    checking, never = asyncio.Event(), asyncio.Event()

    async def slow_check(sampling):  # as a large schema's compile: the client leaves meanwhile
        checking.set()
        await never.wait()

    server.launcher.acheck_structured = slow_check

    async def leave_during_the_check():
        answering = asyncio.create_task(server.chat_completions(post("/v1/chat/completions", STRUCTURED)))
        await checking.wait()
        answering.cancel()  # as Serve cancels the request of a client that left
        with pytest.raises(asyncio.CancelledError):
            await answering

    asyncio.run(leave_during_the_check())
    assert counted_requests(server) == {'finish_reason="abort",status="499"': 1.0}
