"""How fast a pool's requests have left their rows lately: what a client refused for a full queue is
told to wait (Retry-After) before its request could be taken.

A full queue takes a new request once one running request ends and a waiting one takes its row, so
the wait is about the time between two recent ends: the window's span (up to now, so a pool whose
requests stopped ending says a longer wait) over the ends it holds, but never less than the time
since the last end (a burst of ends and then a stall says the stall). With fewer than two ends in the
window (long requests, or a pool that stopped ending them) it is the time since the last end, up
to LONGEST_WAIT_S; only a pool where nothing has ended yet says the least wait, one second.

Time with nothing in flight is no stall: when a request comes to an idle pool (no request in its
books, no cancel owed, no group restarting: ReplicaPool._idle), the ends it holds are moved on by the
idle time, as if it had not passed. A server idle for a minute told the first client
its burst turned away to wait 60 s (the `openai` client waits that long).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0
"""Only ends this recent count (older ones say little of the load now)."""
KEPT = 64
LONGEST_WAIT_S = 60
"""The longest wait told: past it the estimate says less than a retry would."""


class FinishRate:
    """Ends recorded by the replicas' threads (request finished, cancelled or failed), read under
    the pool's admission lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ends: deque[float] = deque(maxlen=KEPT)
        """The latest ends (the last one kept however old: a stalled pool's wait grows from it)."""
        self._lock = threading.Lock()

    def record(self) -> None:
        with self._lock:
            self._ends.append(self._clock())

    def became_busy(self) -> None:
        """A request came to a pool with none in flight (called under the pool's admission lock)."""
        with self._lock:
            if self._ends:
                idle = self._clock() - self._ends[-1]  # the last request to leave left the pool idle
                self._ends = deque((end + idle for end in self._ends), maxlen=KEPT)

    def retry_after_s(self) -> int:
        """Whole seconds a refused client should wait (the module's doc), 1 to LONGEST_WAIT_S."""
        now = self._clock()
        with self._lock:
            ends = list(self._ends)
        if not ends:
            return 1
        recent = [t for t in ends if now - t <= WINDOW_S]
        pace = (now - recent[0]) / len(recent) if len(recent) >= 2 else 0.0
        # never a pace faster than the time since the last end: after a burst and then a stall the
        # window's average said a second for up to a minute, and then jumped to a minute
        wait = max(pace, now - ends[-1])
        return min(LONGEST_WAIT_S, max(1, math.ceil(wait)))
