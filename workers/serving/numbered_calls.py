"""Run calls in the order their sender numbered them, whatever order they arrive in.

Rank 0 is a threaded Ray actor (several of its methods run at once, so that submissions get
through while the serving loop holds a thread), and Ray does not keep the order of a threaded
actor's calls: a cancel sent right after its submit can reach the serving loop first, find nothing
to cancel, and leave the request to run to its last token. The driver numbers each submit and
cancel it sends to one group (0, 1, 2, ...), and rank 0 hands them to the loop in that order.
"""

from __future__ import annotations

import threading
from typing import Callable


class NumberedCalls:
    def __init__(self) -> None:
        self._next = 0
        self._held: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()

    def run(self, number: int, call: Callable[[], None]) -> None:
        """Run `call` once every call numbered below it has run, and then any held call it frees.
        Calls run under the lock, one at a time, so they must be quick (the loop's own inbox puts
        are). An error never blocks the calls after it; it is raised to the sender when the call
        ran at once, and dropped when it was held (its sender has returned by then; the driver
        sends these calls without waiting for their answers)."""
        with self._lock:
            if number < self._next or number in self._held:
                raise ValueError(f"call number {number} was already given (next expected: {self._next})")
            self._held[number] = call
            errors: dict[int, BaseException] = {}
            while self._next in self._held:
                current, self._next = self._next, self._next + 1
                try:
                    self._held.pop(current)()
                except Exception as err:  # noqa: BLE001 - reported to its own sender below, if it is this one
                    errors[current] = err
        if number in errors:
            raise errors[number]

    @property
    def held(self) -> int:
        """Calls waiting for an earlier number."""
        with self._lock:
            return len(self._held)
