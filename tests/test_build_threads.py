"""Structured requests' matchers are built on a bounded set of shared daemon threads: one thread per
build started 8,000 threads for 8,000 structured requests arriving at once (about 4 s of the leader's
loop). A build whose request is dropped while it still waits for a thread never runs; one already
running is abandoned: it ends on a thread that then exits and holds none of the shared ones, so hung
builds of requests nobody waits for hold up no other request, and a request whose build has not ended
after grammar_wait_s fails alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest

from tests.test_mass_cancel_structured import SPEC, held_loop
from tests.serving_driver import collect, request, run_loops, stop
from workers.structured.build_threads import BUILD_THREADS, BuildThreads


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
        assert sum(t.name == "test-build" for t in threading.enumerate()) == 3
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


def _named_threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


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
        deadline = time.monotonic() + 10
        while not all(f.running() for f in hung) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(f.running() for f in hung) and not queued.done()
        for future in hung:
            pool.abandon(future)
            pool.abandon(future)  # a second abandon of the same build changes nothing
        assert queued.result(timeout=10) == "cheap"
        assert pool.detached == 2 and pool.threads <= 2 and _named_threads(name) <= 4
    finally:
        release.set()
    assert [f.result(timeout=30) for f in hung] == [True, True]
    deadline = time.monotonic() + 10
    while _named_threads(name) > pool.limit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _named_threads(name) == pool.limit and pool.detached == 0 and pool.threads == pool.limit
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
        deadline = time.monotonic() + 10
        while not all(f.running() for f in slow_futures) and time.monotonic() < deadline:
            time.sleep(0.01)
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
    assert "the structured output's grammar was not built after" in error and "on the group's leader" in error
    assert not loop._building
