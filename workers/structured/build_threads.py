"""Where the group leader builds structured requests' matchers: a few daemon threads shared by all
builds, started as builds arrive.

llguidance releases the GIL while it compiles, so a grammar that takes a second or more (a JSON
schema of 10,000 required properties took 0.9 s on one 2-core host) leaves the serving loop stepping
the other requests meanwhile. A thread of its own per build started 8,000 threads for 8,000
structured requests arriving at once (about 4 s of the leader's loop spent starting them, and a
thread stack each); a bounded set keeps that to BUILD_THREADS, while enough of them run side by
side that a cheap grammar seldom waits behind a costly one. Daemon threads, as a rank exits without
waiting for a build nobody will read."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

BUILD_THREADS = 16
"""Most builds that run at once on one leader; more wait in arrival order."""


class BuildThreads:
    """Runs build() calls on at most `limit` daemon threads, started only while every started
    one is busy. A build whose Future was cancelled before a thread took it never runs."""

    def __init__(self, limit: int = BUILD_THREADS, name: str = "corelaunch-grammar-build") -> None:
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be at least 1 thread")
        self.limit, self._name = limit, name
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[Future, Callable[[], object]]] = collections.deque()
        self._has_jobs = threading.Condition(self._lock)
        self._started = 0
        self._idle = 0

    def submit(self, build: Callable[[], object]) -> Future:
        """build()'s result (or error) in the returned Future, once a thread has run it."""
        future: Future = Future()
        with self._lock:
            self._jobs.append((future, build))
            if self._idle >= len(self._jobs):
                self._has_jobs.notify()
            elif self._started < self.limit:
                self._started += 1
                threading.Thread(target=self._serve, name=self._name, daemon=True).start()
            else:
                self._has_jobs.notify()
        return future

    @property
    def threads(self) -> int:
        """How many threads have been started (never more than the limit)."""
        with self._lock:
            return self._started

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._idle += 1
                    self._has_jobs.wait()
                    self._idle -= 1
                future, build = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():  # its request was dropped while it waited
                continue
            try:
                future.set_result(build())
            except BaseException as err:  # noqa: BLE001 - handed to whoever reads the future
                future.set_exception(err)


_shared: BuildThreads | None = None
_shared_lock = threading.Lock()


def build_in_the_background(build: Callable[[], object]) -> Future:
    """build() run on this process's shared BuildThreads; its result (or error) in the Future."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BuildThreads()
    return _shared.submit(build)
