"""Where the group leader builds structured requests' matchers: a few daemon threads shared by all
builds, started as builds arrive.

llguidance releases the GIL while it compiles, so a grammar that takes a second or more (a JSON
schema of 10,000 required properties took 0.9 s on one 2-core host) leaves the serving loop stepping
the other requests meanwhile. A thread of its own per build started 8,000 threads for 8,000
structured requests arriving at once (about 4 s of the leader's loop spent starting them, and a
thread stack each); a bounded set keeps that to BUILD_THREADS. Builds start in arrival order, so a
cheap grammar that arrives while BUILD_THREADS costly ones run waits until one of them ends (or is
abandoned: its request was dropped or its build ran too long), and behind every costly one queued
before it. A build cannot be stopped once it runs (llguidance has no way to interrupt a compile), so
abandon() detaches its thread instead: that thread exits once the build ends, and no longer holds
one of the BUILD_THREADS, so a hung build of a request nobody waits for holds up no other. At most
BUILD_THREADS builds are detached at once: otherwise a client that sends costly grammars and cancels
each once it runs would start a compile per cancel, all burning CPU together. Past that cap an
abandoned build keeps its thread (no replacement starts) until it ends or a detached one ends first
and it is detached in its place, so at most 2 x BUILD_THREADS builds ever run at once. Each Future
records when its build started (BuildFuture.started), so a caller times a build from then, not from
when it queued behind others. Daemon threads, as a rank exits without waiting for a build nobody
will read."""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

BUILD_THREADS = 16
"""Most builds that run at once on one leader for requests still waiting for them; at most as many
abandoned ones run on besides, each on a thread that exits when it ends; more wait in arrival order."""


class BuildFuture(Future):
    """A build's Future, with when a thread started running it."""

    def __init__(self) -> None:
        super().__init__()
        self.started: float | None = None
        """time.monotonic() when the build began to run; None while it waits for a thread (or was
        cancelled before one took it): a deadline counted from here is not spent queued."""


class _Run(enum.Enum):
    WANTED = "wanted"
    """Someone will read its result; its thread counts toward the limit."""
    DETACHED = "detached"
    """Abandoned; its thread exits after it and no longer counts toward the limit."""
    KEPT = "kept"
    """Abandoned while `limit` builds were already detached: its thread keeps its place in the
    limit (and serves on after it) unless a detached build ends first and it is detached then."""


class BuildThreads:
    """Runs build() calls on at most `limit` daemon threads, started only while every started
    one is busy, plus at most `limit` more, one per abandoned build still running (so at most
    2 x limit builds run at once). A build whose Future was cancelled (or abandoned) before a thread
    took it never runs."""

    def __init__(self, limit: int = BUILD_THREADS, name: str = "corelaunch-grammar-build") -> None:
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be at least 1 thread")
        self.limit, self._name = limit, name
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[BuildFuture, Callable[[], object]]] = collections.deque()
        self._has_jobs = threading.Condition(self._lock)
        self._started = 0
        """Threads that count toward the limit (not the detached ones)."""
        self._idle = 0
        self._detached = 0
        self._running: dict[BuildFuture, _Run] = {}
        """The builds now running, each with whether it is wanted, detached or kept (_Run)."""

    def submit(self, build: Callable[[], object]) -> BuildFuture:
        """build()'s result (or error) in the returned Future, once a thread has run it."""
        future = BuildFuture()
        with self._lock:
            self._jobs.append((future, build))
            self._serve_the_queue()
        return future

    def abandon(self, future: Future) -> None:
        """Nobody will read this build's result: one still queued never runs; a running one goes on
        (it cannot be stopped) on a thread that exits when it ends and no longer counts toward the
        limit, so a queued build may start on a new thread meanwhile - unless `limit` builds are
        detached already: then it keeps its thread's place until it ends or one of those ends."""
        if future.cancel():  # still queued (or already cancelled)
            return
        with self._lock:
            if self._running.get(future) is not _Run.WANTED:  # done, or abandoned already
                return
            if self._detached < self.limit:
                self._detach(future)
            else:
                self._running[future] = _Run.KEPT

    def _detach(self, future: Future) -> None:
        """Free the place of a running build's thread and start the queue's next build (lock held)."""
        self._running[future] = _Run.DETACHED
        self._detached += 1
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
        """How many abandoned builds still run on a thread that exits when it ends (at most limit)."""
        with self._lock:
            return self._detached

    @property
    def running(self) -> int:
        """How many builds run now, wanted or abandoned (at most 2 x limit)."""
        with self._lock:
            return len(self._running)

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
                future.started = time.monotonic()
                self._running[future] = _Run.WANTED
            try:
                result, error = build(), None
            except BaseException as err:  # noqa: BLE001 - handed to whoever reads the future
                result, error = None, err
            with self._lock:
                state = self._running.pop(future)
                if state is _Run.DETACHED:
                    self._detached -= 1
                    kept = next((f for f, s in self._running.items() if s is _Run.KEPT), None)
                    if kept is not None:  # under the cap again: it gives up its place in the limit
                        self._detach(kept)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
            if state is _Run.DETACHED:  # a replacement took this thread's place in the limit
                return


_shared: BuildThreads | None = None
_shared_lock = threading.Lock()


def _the_shared() -> BuildThreads:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BuildThreads()
    return _shared


def build_in_the_background(build: Callable[[], object]) -> BuildFuture:
    """build() run on this process's shared BuildThreads; its result (or error) in the Future, which
    says when the build began to run (BuildFuture.started)."""
    return _the_shared().submit(build)


def abandon_build(future: Future) -> None:
    """Nobody will read this build (its request was dropped): BuildThreads.abandon on the shared set."""
    _the_shared().abandon(future)
