"""Bounds on a request's head (request line and headers) for the replica's own HTTP server.

With direct ingress (launcher/serving/ingress.py) the one Serve replica's uvicorn server answers
--port. Ray Serve 2.60 builds its uvicorn.Config with no protocol settings, so uvicorn takes
httptools, which bounds neither the size of a head nor the time it may take to arrive; and a
connection that never sends a request is never closed. Before the API key is checked (it is a
header), any client could then grow the replica's memory without limit with one unfinished
header (200 MB on each of three connections: 0.5 to 1.3 GB), or hold every file descriptor with
idle connections (the replica stopped answering /health, while Serve's own health check, which
does not use HTTP, kept it in place).

Each connection of the replica's server is therefore an httptools protocol that answers 431 and
closes once a head passes MAX_HEAD_BYTES before it is complete, and closes a connection whose next
head has not arrived whole within HEAD_TIMEOUT_S (408 where part of it came). Bodies have their own
budget and deadline (openai_app.py); a request answered before its body arrived whole (401 with no
key, 404, 413, the body's 408) ends its connection: the answer says `connection: close`, then the
replica stops sending, discards at most LINGER_BYTES more for at most LINGER_S, so the client can
read the answer rather than a reset, and closes. uvicorn kept such a connection open, reading and
discarding whatever the declared length promised (10 GB took 7.5 s of a core), and every byte
restarted its keep-alive timer: unauthenticated clients trickling a byte a minute held every file
descriptor of the replica. Serve offers no setting for these, so the replica's process gives the
uvicorn module Serve's HTTP helper uses a Config that names this protocol; it does nothing if the
helper is missing or changed shape. Serve's proxy (proxy ingress) runs in Serve's own
process and keeps Serve's settings.
"""

from __future__ import annotations

import asyncio
import types

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes a request line and headers may take (h11, uvicorn's other parser, stops at 16 KiB;
OpenAI's clients send well under 2 KiB)."""
HEAD_TIMEOUT_S = 30.0
"""How long a connection may take to send a whole head: from its opening for the first request,
and from the first byte of each later one (a lone CRLF included; the time between requests is
uvicorn's keep-alive). A head sent while the answer before it is still being written gets the time
again once it has passed with that answer unfinished."""
LINGER_S = 5.0
"""How long a connection answered before its request's body ended is kept reading (and discarding)
before it is closed: closing with the client's bytes unread resets the connection, and the reset
destroys the answer the client had not read yet (a 413 became "connection reset")."""
LINGER_BYTES = 64 * 1024 * 1024
"""The most body bytes discarded in that time (counted, not parsed): a client that sends a body
past the server's limit (a few MB) still reads its 413."""


def bounded_protocol_class():
    """uvicorn's httptools protocol with the two bounds (a class made on first use: uvicorn and
    httptools are imported only in a process that serves)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHeadProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._in_head = True  # waiting for (the rest of) a request's head
            self._head_timer: asyncio.TimerHandle | None = None
            self._lingering = False  # answered, sending no more; discarding what still comes
            self._linger_bytes = 0
            self._linger_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                self._linger_bytes += len(data)
                if self._linger_bytes > LINGER_BYTES:
                    self.transport.close()
                return
            if self._in_head:
                self._head_bytes += len(data)  # a chunk may carry the body's start too: counted, harmless
                # uvicorn stops its keep-alive timer on any byte, and the parser skips the empty lines
                # before a request line without a message begun: a lone CRLF held the connection forever
                self._start_head_timer()
            super().data_received(data)
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._refuse(b"431 Request Header Fields Too Large",
                             f"the request line and headers passed {MAX_HEAD_BYTES} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._start_head_timer()

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._stop_head_timer()
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:  # a request's cycle (an upgrade makes none)
                self._end_early_answers(self.cycle)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True  # the next request's head; its time starts with its first byte

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_head and self._head_timer is not None:
                # a head sent ahead while this answer was written: its time runs from now (the timer
                # restarted while the answer ran could fire just after its end: a 408 at once)
                self._stop_head_timer()
                self._start_head_timer()

        def _end_early_answers(self, cycle) -> None:
            """An answer that starts before its own request's body has ended (a 401 without the key,
            a 413) says `connection: close`, so that no client sends another request on the
            connection, and then lingers instead of closing (uvicorn closes at once where an answer
            says it: the unread body would reset the connection and lose the answer). Per request:
            a pipelined request's body still arriving is not the answered one's."""
            send, lingering = cycle.send, _LingerOnClose(cycle.transport, self._linger)

            async def send_ending_early(message) -> None:
                if message["type"] == "http.response.start" and cycle.more_body and not cycle.response_started:
                    cycle.keep_alive = False  # uvicorn writes `connection: close` and closes once answered
                    cycle.transport = lingering
                await send(message)

            cycle.send = send_ending_early  # what the app is given (run_asgi passes self.send)

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

        def _linger(self) -> None:
            if self._lingering:
                return
            self._lingering = True
            try:
                self.transport.write_eof()  # the answer goes out, then the end of what this side sends
            except (NotImplementedError, OSError, RuntimeError):
                self.transport.close()
                return
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

        def _start_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_overdue)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_overdue(self) -> None:
            self._head_timer = None
            if not self._in_head or self._lingering or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # the answer before this head is still being written: a 408 would land inside it; the
                # head's time starts again at the answer's end (on_response_complete)
                self._start_head_timer()
                return
            if self._head_bytes:
                self._refuse(b"408 Request Timeout", f"the request's headers did not arrive within "
                                                     f"{HEAD_TIMEOUT_S:g} s")
            else:
                self.transport.close()  # never asked anything

        def _refuse(self, status: bytes, message: str) -> None:
            body = message.encode()
            self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

    return BoundedHeadProtocol


class _LingerOnClose:
    """A request cycle's transport whose close() (uvicorn's, once an answer that says `connection:
    close` is sent) lingers instead; everything else is the connection's own transport."""

    def __init__(self, transport, linger) -> None:
        self._transport, self._linger = transport, linger

    def close(self) -> None:
        self._linger()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def bound_request_heads() -> bool:
    """Give Serve's HTTP helper (ray.serve._private.http_util) in this process a uvicorn whose
    Config uses the bounded protocol; True if patched now or before, False where the helper is
    missing or not as expected."""
    try:
        from ray.serve._private import http_util
        import uvicorn
    except ImportError:
        return False
    current = getattr(http_util, "uvicorn", None)
    if getattr(current, "bounded_request_heads", False):
        return True
    if current is not uvicorn or not hasattr(http_util, "start_asgi_http_server"):
        return False
    try:
        protocol = bounded_protocol_class()
    except ImportError:  # uvicorn without httptools parses with h11, which bounds a head's size itself
        return False

    def config(*args, **kwargs):
        kwargs.setdefault("http", protocol)
        return uvicorn.Config(*args, **kwargs)

    shim = types.ModuleType("uvicorn")
    shim.__dict__.update(uvicorn.__dict__)
    shim.Config = config
    shim.bounded_request_heads = True
    http_util.uvicorn = shim
    return True
