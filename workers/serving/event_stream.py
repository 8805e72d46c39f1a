"""Rank 0's token events to the driver over one TCP connection, as length-prefixed pickle frames.

Why not a Ray actor call per step (the driver polling rank 0): each call costs about a millisecond of
CPU split between the two processes, and on a small machine that millisecond is taken from the
forward's own threads every step, so a lone stream decoded about a tenth slower than a static batch
(README, Measured). A frame on an open socket costs tens of microseconds. Ray still carries
everything else: requests, cancellations, static batches, and the loops' ends (which name a failure).

The driver listens (launcher/cluster/event_channel.py); rank 0 connects and first sends the token the
driver handed it through Ray, so nothing else can feed the driver frames. Then a sender thread
forwards the loop's outbox: every batch of events as soon as it is posted, and at least one frame
each KEEPALIVE_S so the driver can tell a quiet group from a silent one. Each frame is
(events, load, counters).
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from typing import Callable

HEADER = struct.Struct("!I")
KEEPALIVE_S = 1.0
SEND_TIMEOUT_S = 60.0
"""A driver that reads nothing for this long is gone: the sender stops (the loop never waits on it)."""


def encode_frame(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Reassembles frames from the bytes a socket hands over in arbitrary pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """The messages completed by `data` (none while a frame is still partial)."""
        self._buffer += data
        messages, start = [], 0
        while len(self._buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer, start)
            end = start + HEADER.size + size
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(self._buffer[start + HEADER.size:end]))
            start = end
        del self._buffer[:start]
        return messages


class EventSender:
    """Forwards a ServingLoop's outbox to the driver until the loop has ended and the outbox is empty."""

    def __init__(self, outbox, counters: Callable[[], dict]) -> None:
        self.outbox, self.counters = outbox, counters
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def connect(self, host: str, port: int, token: bytes, timeout_s: float) -> None:
        """Connect and authenticate; raises OSError naming the address when the driver cannot be reached."""
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as err:
            raise OSError(f"rank 0 could not connect to the driver's event port {host}:{port} within "
                          f"{timeout_s:g} s ({err}); a firewall between the nodes must allow it") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small frame per step: no batching delay
        sock.settimeout(SEND_TIMEOUT_S)
        sock.sendall(token)
        self._sock = sock
        self._thread = threading.Thread(target=self._forward, name="corelaunch-event-sender", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        sock = self._sock
        try:
            while True:
                closed = self.outbox.closed
                events, load = self.outbox.take(KEEPALIVE_S)
                sock.sendall(encode_frame((events, load, self.counters())))
                if closed and not events:
                    return
        except OSError:
            return  # the driver went away; it sees the group as failed on its side
        finally:
            sock.close()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
