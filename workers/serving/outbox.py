"""Events the leader produced and the driver has not fetched yet (thread-safe, long-poll)."""

from __future__ import annotations

import threading

from workers.serving.requests import TokenEvent


class Outbox:
    def __init__(self) -> None:
        self._events: list[TokenEvent] = []
        self._ready = threading.Condition()
        self.load = {"running": 0, "waiting": 0}
        self.closed = False
        """Set when the loop has ended: nothing more will be put, takers stop waiting."""

    def put(self, events: list[TokenEvent], load: dict[str, int]) -> None:
        with self._ready:
            self._events.extend(events)
            self.load = load
            if events:
                self._ready.notify_all()

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def take(self, wait_s: float) -> tuple[list[TokenEvent], dict[str, int]]:
        """Every waiting event (waiting up to wait_s for the first, unless closed), and the latest load."""
        with self._ready:
            if not self._events and not self.closed and wait_s > 0:
                self._ready.wait(wait_s)
            events, self._events = self._events, []
            return events, dict(self.load)
