"""Where the group leader builds structured requests' matchers: a few daemon threads shared by all
builds, started as builds arrive.

llguidance releases the GIL while it compiles, so a grammar that takes a second or more (a JSON
schema of 10,000 required properties took 0.9 s on one 2-core host) leaves the serving loop stepping
the other requests meanwhile. A thread of its own per build started 8,000 threads for 8,000
structured requests arriving at once (about 4 s of the leader's loop spent starting them, and a
thread stack each); a bounded set keeps that to BUILD_THREADS. Builds start in arrival order, so a
cheap grammar that arrives while BUILD_THREADS costly ones run waits until one of them ends (or is
abandoned: its request was dropped or waited too long), and behind every costly one queued before
it. A build cannot be stopped once it runs (llguidance has no way to interrupt a compile), so
abandon() detaches its thread instead: that thread exits once the build ends, and no longer holds
one of the BUILD_THREADS, so a hung build of a request nobody waits for holds up no other. Daemon
threads, as a rank exits without waiting for a build nobody will read."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

BUILD_THREADS = 16
"""Most builds that run at once on one leader for requests still waiting for them (abandoned ones
run on besides, each on a thread that exits when it ends); more wait in arrival order."""


class BuildThreads:
    """Runs build() calls on at most `limit` daemon threads, started only while every started
    one is busy, plus one per abandoned build still running. A build whose Future was cancelled
    (or abandoned) before a thread took it never runs."""

    def __init__(self, limit: int = BUILD_THREADS, name: str = "corelaunch-grammar-build") -> None:
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be at least 1 thread")
        self.limit, self._name = limit, name
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[Future, Callable[[], object]]] = collections.deque()
        self._has_jobs = threading.Condition(self._lock)
        self._started = 0
        """Threads that count toward the limit (not the detached ones)."""
        self._idle = 0
        self._running: dict[Future, bool] = {}
        """The builds now running, each with whether it was abandoned (its thread then exits after it)."""

    def submit(self, build: Callable[[], object]) -> Future:
        """build()'s result (or error) in the returned Future, once a thread has run it."""
        future: Future = Future()
        with self._lock:
            self._jobs.append((future, build))
            self._serve_the_queue()
        return future

    def abandon(self, future: Future) -> None:
        """Nobody will read this build's result: one still queued never runs; a running one goes on
        (it cannot be stopped) on a thread that exits when it ends and no longer counts toward the
        limit, so a queued build may start on a new thread meanwhile."""
        if future.cancel():  # still queued (or already cancelled)
            return
        with self._lock:
            if self._running.get(future) is not False:  # done, or abandoned already
                return
            self._running[future] = True
            self._started -= 1
            self._serve_the_queue()

    def _serve_the_queue(self) -> None:
        """Wake an idle thread for the newest job, or start one while under the limit (lock held)."""
        if not self._jobs:
            return
        if self._idle >= len(self._jobs) or self._started >= self.limit:
            self._has_jobs.notify()
        else:
            self._started += 1
            threading.Thread(target=self._serve, name=self._name, daemon=True).start()

    @property
    def threads(self) -> int:
        """How many threads count toward the limit (never more than it)."""
        with self._lock:
            return self._started

    @property
    def detached(self) -> int:
        """How many abandoned builds still run, each on a thread that exits when it ends."""
        with self._lock:
            return sum(self._running.values())

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._idle += 1
                    self._has_jobs.wait()
                    self._idle -= 1
                future, build = self._jobs.popleft()
                # Marked running under the lock, so abandon() either cancels it or finds it running.
                if not future.set_running_or_notify_cancel():  # its request was dropped while it waited
                    continue
                self._running[future] = False
            try:
                result, error = build(), None
            except BaseException as err:  # noqa: BLE001 - handed to whoever reads the future
                result, error = None, err
            with self._lock:
                abandoned = self._running.pop(future)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
            if abandoned:  # a replacement took this thread's place in the limit
                return


_shared: BuildThreads | None = None
_shared_lock = threading.Lock()


def _the_shared() -> BuildThreads:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BuildThreads()
    return _shared


def build_in_the_background(build: Callable[[], object]) -> Future:
    """build() run on this process's shared BuildThreads; its result (or error) in the Future."""
    return _the_shared().submit(build)


def abandon_build(future: Future) -> None:
    """Nobody will read this build (its request was dropped): BuildThreads.abandon on the shared set."""
    _the_shared().abandon(future)
