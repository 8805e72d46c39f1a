"""Structured requests' matchers are built on a bounded set of shared daemon threads: one thread per
build started 8,000 threads for 8,000 structured requests arriving at once (about 4 s of the leader's
loop). A build whose request is dropped while it still waits for a thread never runs."""

from __future__ import annotations

import threading
from concurrent.futures import wait

import pytest

from tests.test_mass_cancel_structured import SPEC, held_loop
from tests.serving_driver import request
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
        futures = {rid: future for rid, (_, future) in loop._building.items()}
        events = []
        loop._apply(("cancel", ids[-50:]), events)
        assert [e.finish_reason for e in events] == ["abort"] * 50
        assert all(futures[rid].cancelled() for rid in ids[-50:])
    finally:
        release.set()
    _, pending = wait([futures[rid] for rid in ids[:-50]], timeout=60)
    assert not pending
    assert sorted(calls) == sorted(ids[:-50])
