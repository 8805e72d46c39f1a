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

from workers.net import address_family
from workers.serving.event_stream import FrameReader

TOKEN_BYTES = 32
_ACCEPT_SLICE_S = 0.2
"""accept() wakes this often to ask whether the connecting side has already failed."""
AUTH_TIMEOUT_S = 1.0
"""How long one connection has to send the whole token, from its accept."""
MAX_PENDING = 64
"""Connections read at once while waiting for rank 0's; past this the oldest is dropped."""


class ChannelClosed(Exception):
    """Rank 0 closed its end (its loop ended, or its process died)."""


class EventChannel:
    def __init__(self, host: str) -> None:
        """host: the address rank 0 connects to (loopback when it shares the driver's node)."""
        # an IPv6 node address needs an IPv6 socket (an IPv4 one refuses it)
        self._server: socket.socket | None = socket.create_server((host, 0), family=address_family(host))
        self.address = (host, self._server.getsockname()[1])
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._conn: socket.socket | None = None
        self._reader = FrameReader()
        self._selector: selectors.BaseSelector | None = None
        self._ended = False

    def accept(self, timeout_s: float, gave_up: Callable[[], None] = lambda: None) -> None:
        """Wait for rank 0's connection and token. gave_up() is called between waits and may raise
        (the connecting side failed); TimeoutError when nothing valid arrived within timeout_s.

        Every connection that arrives is read at the same time, each given AUTH_TIMEOUT_S for the
        whole token: connections were checked one at a time, with a timeout per read, so one that
        sent a byte a second held rank 0's real connection in the backlog for the whole start-up
        timeout (anyone who can reach the port could stop a group from starting)."""
        deadline = time.monotonic() + timeout_s
        server = self._server
        server.setblocking(False)
        waiting = selectors.DefaultSelector()
        waiting.register(server, selectors.EVENT_READ)
        pending: dict[socket.socket, list] = {}  # connection -> [token bytes so far, its deadline]
        winner = None
        try:
            while winner is None:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"no connection from rank 0 on {self.address[0]}:{self.address[1]} "
                                       f"within {timeout_s:g} s")
                gave_up()
                for key, _ in waiting.select(min(_ACCEPT_SLICE_S, deadline - now)):
                    if key.fileobj is server:
                        self._take(server, waiting, pending)
                    # one the accept above dropped (MAX_PENDING) in this same batch: already closed
                    elif key.fileobj in pending and self._read_token(key.fileobj, waiting, pending):
                        winner = key.fileobj
                        break
                now = time.monotonic()
                for conn in [c for c, (_, until) in pending.items() if until <= now and c is not winner]:
                    self._drop(conn, waiting, pending)
        finally:
            for conn in list(pending):
                if conn is not winner:
                    self._drop(conn, waiting, pending)
            waiting.close()
        server.close()
        self._server = None
        self._conn = winner
        # A selector, not select.select: a driver holding many sockets may have descriptors >= 1024.
        self._selector = selectors.DefaultSelector()
        self._selector.register(winner, selectors.EVENT_READ)

    @staticmethod
    def _take(server: socket.socket, waiting, pending: dict) -> None:
        try:
            conn, _ = server.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        if len(pending) >= MAX_PENDING:
            EventChannel._drop(next(iter(pending)), waiting, pending)
        pending[conn] = [b"", time.monotonic() + AUTH_TIMEOUT_S]
        waiting.register(conn, selectors.EVENT_READ)

    def _read_token(self, conn: socket.socket, waiting, pending: dict) -> bool:
        """Read what `conn` has of its token; True once it has sent the right one whole."""
        received = pending[conn][0]
        try:
            piece = conn.recv(TOKEN_BYTES - len(received))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            piece = b""
        if not piece:
            self._drop(conn, waiting, pending)
            return False
        received += piece
        pending[conn][0] = received
        if len(received) < TOKEN_BYTES:
            return False
        if hmac.compare_digest(received, self.token):
            waiting.unregister(conn)
            del pending[conn]
            return True
        self._drop(conn, waiting, pending)
        return False

    @staticmethod
    def _drop(conn: socket.socket, waiting, pending: dict) -> None:
        pending.pop(conn, None)
        try:
            waiting.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

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
