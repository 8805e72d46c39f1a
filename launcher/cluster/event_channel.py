"""The driver's end of a serving group's event stream (the sender is workers/serving/event_stream.py).

One listening socket per serving group: rank 0 connects once, proves itself with the random token it
was handed through Ray, and from then on every frame it sends is (events, load, counters). The
listener is closed as soon as that one connection is accepted.
"""

from __future__ import annotations

import hmac
import secrets
import pickle
import selectors
import socket
import time
from typing import Callable

from workers.serving.event_stream import FrameReader

TOKEN_BYTES = 32
_ACCEPT_SLICE_S = 0.2
AUTH_TIMEOUT_S = 1.0
"""accept() wakes this often to ask whether the connecting side has already failed."""


class ChannelClosed(Exception):
    """Rank 0 closed its end (its loop ended, or its process died)."""


class EventChannel:
    def __init__(self, host: str) -> None:
        """host: the address rank 0 connects to (loopback when it shares the driver's node)."""
        self._server: socket.socket | None = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._conn: socket.socket | None = None
        self._reader = FrameReader()
        self._selector: selectors.BaseSelector | None = None
        self._ended = False

    def accept(self, timeout_s: float, gave_up: Callable[[], None] = lambda: None) -> None:
        """Wait for rank 0's connection and token. gave_up() is called between waits and may raise
        (the connecting side failed); TimeoutError when nothing valid arrived within timeout_s.
        Connections with a wrong token are dropped and waited past."""
        deadline = time.monotonic() + timeout_s
        server = self._server
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no connection from rank 0 on {self.address[0]}:{self.address[1]} "
                                   f"within {timeout_s:g} s")
            gave_up()
            server.settimeout(min(_ACCEPT_SLICE_S, remaining))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if self._authenticated(conn, deadline - time.monotonic()):
                break
            conn.close()
        server.close()
        self._server = None
        conn.setblocking(False)
        self._conn = conn
        # A selector, not select.select: a driver holding many sockets may have descriptors >= 1024.
        self._selector = selectors.DefaultSelector()
        self._selector.register(conn, selectors.EVENT_READ)

    def _authenticated(self, conn: socket.socket, timeout_s: float) -> bool:
        # Short: connections are checked one at a time, and one that sends nothing must not keep
        # rank 0's real connection waiting in the backlog for long.
        conn.settimeout(max(0.1, min(timeout_s, AUTH_TIMEOUT_S)))
        received = b""
        try:
            while len(received) < TOKEN_BYTES:
                piece = conn.recv(TOKEN_BYTES - len(received))
                if not piece:
                    return False
                received += piece
        except OSError:
            return False
        return hmac.compare_digest(received, self.token)

    def receive(self, wait_s: float) -> list:
        """The frames that arrived (waiting up to wait_s for the first bytes); raises ChannelClosed
        once the stream has ended and every frame before its end was returned."""
        conn, selector = self._conn, self._selector
        if conn is None or selector is None or self._ended:
            raise ChannelClosed("rank 0's event stream is closed")
        messages = []
        try:
            if not selector.select(wait_s):
                return []
            while True:
                try:
                    data = conn.recv(1 << 16)
                except BlockingIOError:
                    return messages
                if not data:
                    break
                messages.extend(self._reader.feed(data))
        except (OSError, ValueError, pickle.UnpicklingError, EOFError) as err:
            # A reset connection, a socket closed by another thread (kill), or a frame that does not
            # unpickle: the stream is over either way; the caller asks Ray why.
            self._ended = True
            raise ChannelClosed(f"rank 0's event stream broke: {err}") from None
        self._ended = True
        if messages:
            return messages  # the last frames first; the end on the next call
        raise ChannelClosed("rank 0 closed its event stream")

    def close(self) -> None:
        if self._selector is not None:
            self._selector.close()
        for sock in (self._server, self._conn):
            if sock is not None:
                sock.close()
        self._server = self._conn = self._selector = None
