"""Structured requests' matchers are built on a bounded set of shared daemon threads: one thread per
build started 8,000 threads for 8,000 structured requests arriving at once (about 4 s of the leader's
loop). A build whose request is dropped while it still waits for a thread never runs; one already
running is abandoned: it ends on a thread that then exits and holds none of the shared ones, so hung
builds of requests nobody waits for hold up no other request, and a request whose build has run
grammar_wait_s without ending fails alone. At most `limit` abandoned builds run on detached threads
(a client cancelling costly builds as they start grew them without bound); past that an abandoned
build keeps its place. The time a build waits for a thread is not counted against it: a burst of
healthy builds queued past grammar_wait_s failed them all."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest

from tests.test_mass_cancel_structured import SPEC, held_loop
from tests.serving_driver import collect, request, run_loops, stop
from workers.structured.build_threads import BUILD_THREADS, BuildThreads


def _named_threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def _runs_within(future, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not future.running() and not future.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    return future.running() or future.done()


def _wait_for_spare_threads_to_exit(pool: BuildThreads, name: str) -> None:
    """Wait (up to 10 s) until no more of the named threads run than the pool holds: detached ones exit as they end."""
    deadline = time.monotonic() + 10
    while _named_threads(name) > pool.threads and time.monotonic() < deadline:
        time.sleep(0.01)


def test_builds_beyond_the_limit_wait_for_a_thread_and_all_end_in_order():
    release = threading.Event()
    pool = BuildThreads(limit=3, name="test-build")
    started = []

    def build(i):
        def run():
            started.append(i)
            release.wait(30)
            return i * i
        return run

    futures = [pool.submit(build(i)) for i in range(40)]
    try:
        assert pool.threads == 3
        assert _named_threads("test-build") == 3
        assert sum(f.running() for f in futures) <= 3 and not any(f.done() for f in futures)
    finally:
        release.set()
    done, pending = wait(futures, timeout=30)
    assert not pending
    assert [f.result() for f in futures] == [i * i for i in range(40)]
    assert sorted(started) == list(range(40)) and pool.threads == 3


def test_a_build_cancelled_while_it_waits_never_runs_and_errors_reach_the_future():
    release = threading.Event()
    pool = BuildThreads(limit=1, name="test-build-cancel")
    ran = []
    first = pool.submit(lambda: release.wait(30))
    queued = pool.submit(lambda: ran.append("queued"))
    failing = pool.submit(lambda: 1 / 0)
    assert queued.cancel()
    release.set()
    assert first.result(timeout=30) is True
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=30)
    assert queued.cancelled() and ran == []


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match=r"limit \(0\) must be at least 1"):
        BuildThreads(limit=0)


def test_the_leader_cancels_the_builds_of_requests_dropped_while_they_wait():
    """500 structured requests whose builds hang until released: the leader's builds take at most
    BUILD_THREADS threads, and the 50 cancelled (queued behind the running ones) are never built."""
    release = threading.Event()
    loop = held_loop("build", release)
    calls = []
    loop._grammar = lambda req: (calls.append(req.request_id), release.wait(60))[1]
    ids = [f"s{i}" for i in range(500)]
    try:
        loop._apply(("submit", [request(rid, [5, 9], 4, sampling=SPEC) for rid in ids]), [])
        builders = [t for t in threading.enumerate() if t.name == "corelaunch-grammar-build"]
        assert 0 < len(builders) <= BUILD_THREADS
        futures = {rid: entry[1] for rid, entry in loop._building.items()}
        events = []
        loop._apply(("cancel", ids[-50:]), events)
        assert [e.finish_reason for e in events] == ["abort"] * 50
        assert all(futures[rid].cancelled() for rid in ids[-50:])
    finally:
        release.set()
    _, pending = wait([futures[rid] for rid in ids[:-50]], timeout=60)
    assert not pending
    assert sorted(calls) == sorted(ids[:-50])


def test_an_abandoned_running_build_ends_on_a_thread_that_then_exits():
    """Two hung builds fill a limit of 2; abandoned, each goes on (it cannot be stopped) but frees
    its place: the queued build runs at once on a new thread, and once the hung ones end their
    threads exit, leaving the limit's worth."""
    release = threading.Event()
    name = "test-build-abandon"
    pool = BuildThreads(limit=2, name=name)
    hung = [pool.submit(lambda: release.wait(30)) for _ in range(2)]
    queued = pool.submit(lambda: "cheap")
    try:
        for future in hung:
            _runs_within(future, 10)
        assert all(f.running() for f in hung) and not queued.done()
        for future in hung:
            pool.abandon(future)
            pool.abandon(future)  # a second abandon of the same build changes nothing
        assert queued.result(timeout=10) == "cheap"
        assert pool.detached == 2 and pool.threads <= 2 and _named_threads(name) <= 4
    finally:
        release.set()
    assert [f.result(timeout=30) for f in hung] == [True, True]
    _wait_for_spare_threads_to_exit(pool, name)
    # one replacement or two, as the queued build was taken before the second abandon or not
    assert _named_threads(name) == pool.threads <= pool.limit and pool.detached == 0
    assert pool.submit(lambda: 7).result(timeout=10) == 7  # the threads left still take builds


def test_hung_builds_of_cancelled_requests_do_not_starve_a_cheap_one():
    """BUILD_THREADS structured requests whose builds hang are cancelled by their clients: a cheap
    one arriving next is built at once, not after them (before: never, while one hung)."""
    release = threading.Event()
    loop = held_loop("build", release)
    loop._grammar = lambda req: "built" if req.request_id == "cheap" else release.wait(60)
    slow = [f"slow{i}" for i in range(BUILD_THREADS)]
    try:
        loop._apply(("submit", [request(rid, [5, 9], 4, sampling=SPEC) for rid in slow]), [])
        slow_futures = [loop._building[rid][1] for rid in slow]
        for future in slow_futures:
            _runs_within(future, 10)
        assert all(f.running() for f in slow_futures)
        events = []
        loop._apply(("cancel", slow), events)
        assert [e.finish_reason for e in events] == ["abort"] * BUILD_THREADS
        loop._apply(("submit", [request("cheap", [5, 9], 4, sampling=SPEC)]), [])
        assert loop._building["cheap"][1].result(timeout=10) == "built"
    finally:
        release.set()
    wait(slow_futures, timeout=60)


def test_a_request_whose_build_never_ends_fails_alone_after_the_grammar_wait():
    release = threading.Event()
    loop = held_loop("build", release)
    loop.grammar_wait_s = 0.5
    started = time.monotonic()
    threads = run_loops([loop])
    try:
        loop.submit([request("hung", [5, 9], 4, sampling=SPEC), request("plain", [5, 9], 3)])
        out = collect(loop, {"hung", "plain"}, timeout_s=20)
    finally:
        release.set()
        stop([loop], threads)
    assert out.finish == {"hung": "error", "plain": "length"} and time.monotonic() - started < 20
    [error] = [e.error for e in out.events if e.request_id == "hung"]
    assert "the structured output's grammar was not built after its build ran" in error
    assert "on the group's leader (the limit is 0.5 s)" in error
    assert not loop._building


def test_cancelling_builds_as_they_start_runs_at_most_twice_the_limit():
    """A client sends costly grammars and cancels each once its build runs: before, every abandon
    started a replacement thread, so 60 rounds at a limit of 2 left 60 compiles running at once.
    Now at most `limit` are detached; the next abandoned ones keep their threads' places, so a new
    build waits for one of them instead."""
    release = threading.Event()
    name = "test-build-churn"
    pool = BuildThreads(limit=2, name=name)
    futures = []
    try:
        for _ in range(60):
            futures.append(pool.submit(lambda: release.wait(30)))
            if not _runs_within(futures[-1], 2.0):  # every place taken: it waits for one
                break
            pool.abandon(futures[-1])
        running = sum(f.running() for f in futures)
        assert running == 2 * pool.limit, f"{running} builds run at once with a limit of {pool.limit}"
        assert _named_threads(name) == 2 * pool.limit and pool.detached == pool.limit
        assert pool.threads == pool.limit and not futures[-1].running()
    finally:
        release.set()
    _, pending = wait(futures, timeout=30)
    assert not pending and futures[-1].result() is True  # the one that waited ran once places freed
    _wait_for_spare_threads_to_exit(pool, name)
    assert _named_threads(name) == pool.threads <= pool.limit and pool.detached == 0 and pool.running == 0


def test_a_kept_abandoned_build_is_detached_once_a_detached_one_ends():
    """Limit 1: A is abandoned and detached, B abandoned past the cap keeps the one place, so C
    waits; once A ends, B is detached in its turn and C runs beside it on a new thread."""
    ends = {key: threading.Event() for key in "AB"}
    pool = BuildThreads(limit=1, name="test-build-kept")
    a = pool.submit(lambda: ends["A"].wait(30) and "A")
    try:
        assert _runs_within(a, 10)
        pool.abandon(a)
        b = pool.submit(lambda: ends["B"].wait(30) and "B")
        assert _runs_within(b, 10)
        pool.abandon(b)
        c = pool.submit(lambda: "C")
        assert not _runs_within(c, 0.3) and pool.detached == 1 and pool.running == 2
        ends["A"].set()
        assert c.result(timeout=10) == "C" and b.running() and pool.detached == 1
    finally:
        for end in ends.values():
            end.set()
    assert b.result(timeout=30) == "B"
    assert pool.submit(lambda: 7).result(timeout=10) == 7


def test_builds_queued_past_the_grammar_wait_behind_a_burst_all_succeed():
    """4 x BUILD_THREADS structured requests at once, each build taking 0.5 s of a 1.2 s grammar
    wait: the last waves wait 1-1.5 s for a thread, and before, their healthy builds failed with
    "not built after" (counted from when they were asked for) and were abandoned while running."""
    release = threading.Event()
    release.set()
    loop = held_loop("build", release)
    loop.grammar_wait_s = 1.2
    built = []

    def grammar(req):
        time.sleep(0.5)  # stands for a compile well within the grammar wait
        built.append(req.request_id)

    loop._grammar = grammar  # returns None: the request then runs unconstrained to its length
    ids = [f"s{i}" for i in range(4 * BUILD_THREADS)]
    threads = run_loops([loop])
    try:
        loop.submit([request(rid, [5, 9], 3, sampling=SPEC) for rid in ids])
        out = collect(loop, set(ids), timeout_s=60)
    finally:
        stop([loop], threads)
    errors = sorted({e.error for e in out.events if e.finish_reason == "error"})
    assert not errors, f"{len(errors)} distinct errors, e.g. {errors[0]!r}"
    assert out.finish == dict.fromkeys(ids, "length") and sorted(built) == sorted(ids)
