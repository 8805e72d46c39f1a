"""A streamed answer whose client leaves after its first chunk, with Serve's proxy in front: the
proxy cancels the request's task, and the body's next await raises Ray's TaskCancelledError. The
app's handler for that error (a 499 for a client gone while its body is read) then ran after the
200 had gone out, and Starlette put "Caught handled exception, but response already started" with a
traceback in the replica's log, once per such stream. Real FastAPI and Starlette, in process."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from launcher.serving.openai_app import _client_gone, _ClosingStreamingResponse


class EngineStream:
    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("gone", [TaskCancelledError, ClientDisconnect])
def test_a_client_gone_after_the_first_chunk_ends_the_stream_quietly(gone):
    app = FastAPI()
    app.add_exception_handler(TaskCancelledError, _client_gone)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    engine, closed = EngineStream(), []

    async def body():
        yield "data: first\n\n"
        raise gone()  # the await for the next token, as the proxy cancels the request

    @app.post("/stream")
    async def stream():
        return _ClosingStreamingResponse(body(), engine, lambda: closed.append(1), media_type="text/event-stream")

    with TestClient(app) as client:  # raises what the server raised, as the replica's log showed it
        answer = client.post("/stream")
    assert answer.status_code == 200 and answer.text == "data: first\n\n"
    assert engine.closed == 1 and closed == [1]  # the engine stream closed, the outcome counted once


def test_other_errors_after_the_first_chunk_still_surface():
    app = FastAPI()
    engine = EngineStream()

    async def body():
        yield "data: first\n\n"
        raise RuntimeError("a bug")

    @app.post("/stream")
    async def stream():
        return _ClosingStreamingResponse(body(), engine, lambda: None, media_type="text/event-stream")

    with TestClient(app) as client, pytest.raises(RuntimeError, match="a bug"):
        client.post("/stream")
    assert engine.closed == 1
