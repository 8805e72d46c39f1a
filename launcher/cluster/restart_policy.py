"""How often a replica may be restarted: at most `max_restarts` within any `window_s` seconds.

A worker that crashes on every start or every request would otherwise be restarted forever; past
the bound the replica is given up and its requests fail with an error saying so (and why).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from shardlib.config_fields import finite


MAX_RESTARTS = 10_000
"""The most restarts a window may allow; waits scale with it (a static generate's watchdog)."""


@dataclass
class RestartPolicy:
    max_restarts: int = 3
    """Restarts allowed within window_s; 0: never restart (a fault fails the requests in flight)."""
    window_s: float = 600.0
    """The sliding window the restarts are counted in."""
    _times: deque = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts ({self.max_restarts!r}) must be an integer >= 0 (0 disables restarts)")
        if self.max_restarts > MAX_RESTARTS:
            raise ValueError(f"max_restarts ({self.max_restarts!r}) must be at most {MAX_RESTARTS} (a replica that "
                             f"restarts that often is in a crash loop)")
        w = self.window_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not finite(w) or w <= 0:
            # nan would never let a restart leave the window: every later fault would count
            raise ValueError(f"restart_window_s ({w!r}) must be a finite positive number of seconds")

    def allow(self, now: float | None = None) -> bool:
        """Record a restart at `now` and return True, or return False when the bound is reached."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def recent(self, now: float | None = None) -> int:
        """Restarts counted in the current window."""
        now = time.monotonic() if now is None else now
        return sum(1 for t in self._times if now - t < self.window_s)

    def describe(self) -> str:
        return f"max_restarts={self.max_restarts} per restart_window_s={self.window_s:g}"
