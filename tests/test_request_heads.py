"""launcher/serving/request_heads.py: the replica's own HTTP server bounds a request's head in size
and time, on a real uvicorn server (the protocol Serve's helper is given) and real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest


async def _app(scope, receive, send):
    """A plain ASGI app: 200 "ok" (its body, if any, read first), a slow streamed answer, or a refusal."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/refuse":  # as the server answers 401 or 413: before reading the body
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/slow":  # a response that outlasts the head timeout: never cut by it
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(0.4)
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(monkeypatch):
    """A uvicorn server on a loopback port built as Serve's helper builds it once patched; yields its port."""
    from ray.serve._private import http_util

    from launcher.serving import request_heads

    monkeypatch.setattr(request_heads, "HEAD_TIMEOUT_S", 0.6)
    monkeypatch.setattr(http_util, "uvicorn", http_util.uvicorn)  # the patch undone after the test
    assert request_heads.bound_request_heads() and request_heads.bound_request_heads()  # idempotent
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    config = http_util.uvicorn.Config(_app, loop="none", lifespan="off", log_level="critical", access_log=False)
    served = http_util.uvicorn.Server(config)
    thread = threading.Thread(target=loop.run_until_complete, args=(served.serve(sockets=[sock]),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not served.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield sock.getsockname()[1]
    served.should_exit = True
    thread.join(10)
    sock.close()


def _exchange(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send `data`, then read until the server closes the connection (or wait_s passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as conn:
        conn.sendall(data)
        received = b""
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return received


def test_a_head_past_the_limit_is_refused_before_it_ends(server):
    from launcher.serving.request_heads import MAX_HEAD_BYTES

    unfinished = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (4 * MAX_HEAD_BYTES)  # never ends
    answer = _exchange(server, unfinished)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), answer[:200]
    many = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(20000))
    assert _exchange(server, many).startswith(b"HTTP/1.1 431"), "20 000 headers were taken"
    body = b"x" * (4 * MAX_HEAD_BYTES)  # a large body is not a large head
    answer = _exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                       % len(body) + body)
    assert answer.startswith(b"HTTP/1.1 200") and b"ok" in answer.split(b"\r\n\r\n", 1)[1], answer[:200]


def test_a_connection_that_sends_no_whole_head_in_time_is_closed(server):
    started = time.monotonic()
    assert _exchange(server, b"") == b""  # it never asked: closed without an answer
    assert time.monotonic() - started < 3
    answer = _exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\n")  # a head never finished
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer[:200]


def test_requests_and_long_answers_on_a_kept_connection_are_not_cut(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        for path in (b"/slow", b"/"):  # the slow answer takes 1.2 s, twice the head timeout
            conn.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while not received.endswith(b"ok") and not received.endswith(b"0\r\n\r\n"):
                chunk = conn.recv(65536)
                assert chunk, f"closed after {received[:300]!r}"
                received += chunk
            assert received.startswith(b"HTTP/1.1 200") and b"ok" in received, received[:300]


def _seconds_until_closed(port: int, head: bytes, drip: bytes, every_s: float = 0.05,
                          limit_s: float = 6.0) -> tuple[bytes, float | None]:
    """Send `head`, then `drip` every every_s while reading; (what came back, seconds until the
    server closed the connection, or None if it had not after limit_s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.settimeout(every_s)
        conn.sendall(head)
        received, started = b"", time.monotonic()
        while time.monotonic() - started < limit_s:
            try:
                conn.sendall(drip)
                received += conn.recv(65536)
            except socket.timeout:
                continue
            except OSError:  # reset, or a broken pipe: closed
                return received, time.monotonic() - started
        return received, None


def test_a_request_answered_before_its_body_ended_ends_its_connection(server, monkeypatch):
    """A request refused before its body came (401 without the key, 413) kept its connection: the
    server read and discarded whatever the declared length promised, and each byte restarted the
    keep-alive timer, so clients trickling a byte a minute held every file descriptor."""
    from launcher.serving import request_heads

    monkeypatch.setattr(request_heads, "LINGER_S", 0.5)
    head = b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
    answer, closed_s = _seconds_until_closed(server, head, b"x")  # a trickle: the time bound closes it
    assert answer.startswith(b"HTTP/1.1 401") and answer.endswith(b"no"), answer[:200]
    # and it says so, or a client keeping the connection sent its next request into the discarding
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:300]
    assert closed_s is not None and closed_s < 3, f"still open after {closed_s} s"
    monkeypatch.setattr(request_heads, "LINGER_S", 30.0)
    monkeypatch.setattr(request_heads, "LINGER_BYTES", 64 * 1024)
    answer, closed_s = _seconds_until_closed(server, head, b"x" * 16384)  # a flood: the byte bound closes it
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert closed_s is not None and closed_s < 3, f"still open after {closed_s} s"


def test_pipelined_requests_are_each_answered_and_kept_alive(server):
    """The early-answer close looked at whichever request the parser was reading: with a second
    request pipelined behind the first, its body still arriving when the first was answered, the
    connection was ended and the second never answered."""
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nPOST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        time.sleep(0.3)  # the first is answered while the second's body has not come
        conn.sendall(b"x" * 10)
        received = b""
        while received.count(b"ok") < 2:
            chunk = conn.recv(65536)
            assert chunk, f"closed after {received!r}"
            received += chunk
        assert received.count(b"HTTP/1.1 200") == 2 and b"connection: close" not in received.lower(), received


def _read_chunked_answer(conn: socket.socket) -> bytes:
    """A chunked answer read up to its last chunk; fails if the connection closes first."""
    received = b""
    while not received.endswith(b"0\r\n\r\n"):
        chunk = conn.recv(65536)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return received


def _assert_closed_soon(conn: socket.socket, what: str, limit_s: float = 3.0) -> None:
    """The server closes the connection within limit_s (the head timeout is 0.6 s; uvicorn's
    keep-alive, 5 s, is stopped by any byte), answering nothing or a 408."""
    conn.settimeout(limit_s)
    started, after = time.monotonic(), b""
    try:
        while chunk := conn.recv(65536):
            after += chunk
    except socket.timeout:
        pytest.fail(f"still open {time.monotonic() - started:.1f} s after {what} ({after!r})")
    except ConnectionResetError:
        pass
    assert after == b"" or after.startswith(b"HTTP/1.1 408"), after


def test_a_lone_crlf_after_an_answered_request_does_not_hold_the_connection(server):
    """uvicorn stops its keep-alive timer on any byte, and the parser skips the empty lines before a
    request line without beginning a message: one CRLF after a request (to /health, which needs no
    key) held the connection open for good."""
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_chunked_answer(conn).startswith(b"HTTP/1.1 200")  # answered; the connection kept
        conn.sendall(b"\r\n")
        _assert_closed_soon(conn, "a lone CRLF")


@pytest.mark.parametrize("ahead", [b"\r\n", b"GET / HTTP/1.1\r\n"], ids=["crlf", "pipelined-partial-head"])
def test_bytes_sent_ahead_of_a_slow_answer_do_not_cut_it(server, ahead):
    """The head timer started by bytes of a next head (a CRLF, the start of a pipelined request) ran
    while the answer before it was still being written: past the head timeout it wrote a 408 into the
    middle of that answer, or closed it."""
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")  # its answer takes 1.2 s, twice the head timeout
        time.sleep(0.1)
        conn.sendall(ahead)
        answer = _read_chunked_answer(conn)
        assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"tick\n") == 3, answer
        assert b"408" not in answer and answer.endswith(b"ok\r\n0\r\n\r\n"), answer
        _assert_closed_soon(conn, "the answer")  # and the head sent ahead is still bounded in time


def test_a_head_sent_ahead_of_a_slow_answer_gets_its_whole_time_after_that_answer(server):
    """Its timer, restarted whenever it fired during the answer, could fire just after the answer's
    end: a 408 0.1 s later, where the head is given the whole head timeout (0.6 s here) from then."""
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")  # 1.2 s: the timer fires at 0.7 s, then 1.3 s
        time.sleep(0.1)
        conn.sendall(b"GET / HTTP/1.1\r\n")  # part of the next head, sent ahead
        answer = _read_chunked_answer(conn)
        answered = time.monotonic()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        rest = b""
        try:
            while chunk := conn.recv(65536):
                rest += chunk
        except OSError:
            pass
        waited = time.monotonic() - answered
        assert rest.startswith(b"HTTP/1.1 408") and waited >= 0.5, (waited, rest[:40])
