"""A rank's shutdown under Ray (launcher/cluster/ray_worker.py) when its serving loop is stuck in a
collective for a peer that never comes (it died): the actor's thread stops the loop, waits at most
SHUTDOWN_LOOP_WAIT_S, closes the collectives under it (the stuck call raises CollectivesClosed), and
the compute thread then leaves. Queued behind serve() on the compute thread, the shutdown waited
until the launcher killed the actor. No Ray: the actor's class, called from threads as Ray's are."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from launcher.cluster.ray_worker import RayRankWorker
from tests.test_shm_collectives import thread_ranks
from workers import rank_worker
from workers.rank_worker import WorkerSpec
from workers.shm.exchange import CollectivesClosed

LOOP_WAIT_S = 1.0
"""SHUTDOWN_LOOP_WAIT_S for these tests (5 s in production)."""
MARGIN_S = 3.0
"""What the forced close and the compute thread's release may add (the stuck call sees the close
on its next liveness check)."""


class LoopStuckInACollective:
    """A serving loop whose step waits in an all-reduce for rank 1, which never joins (as a loop whose
    peer died); stop() reaches it only between steps, never."""

    def __init__(self, collectives) -> None:
        self.collectives = collectives
        self.entered = threading.Event()
        self.stops = 0

    def run(self) -> None:
        self.entered.set()
        self.collectives.all_reduce_sum_(torch.ones(8))

    def stop(self) -> None:
        self.stops += 1


def test_shutdown_closes_the_collectives_under_a_loop_stuck_for_a_dead_peer(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # RayRankWorker sends stdout to stderr: restored after
    monkeypatch.setattr(rank_worker, "SHUTDOWN_LOOP_WAIT_S", LOOP_WAIT_S)
    mine, peers = thread_ranks(tmp_path, 2, timeout_s=60.0)  # rank 1's collectives: never used
    worker = RayRankWorker(WorkerSpec(rank=0, world_size=2, backend="cpu", threads=1))
    worker._collectives = mine
    worker._loop = loop = LoopStuckInACollective(mine)
    served: dict = {}

    def serve() -> None:  # an actor thread, as Ray runs the serve call
        try:
            served["result"] = worker.serve()
        except BaseException as e:  # noqa: BLE001 - reported below
            served["error"] = e

    def shut_down() -> None:  # another actor thread
        try:
            worker.shutdown()
            served["shutdown"] = "returned"
        except BaseException as e:  # noqa: BLE001 - reported below
            served["shutdown"] = e

    serving = threading.Thread(target=serve, daemon=True)
    leaving = threading.Thread(target=shut_down, daemon=True)
    try:
        serving.start()
        assert loop.entered.wait(10), "the loop never started on the compute thread"
        time.sleep(0.2)  # inside the all-reduce, waiting for rank 1
        start = time.monotonic()
        leaving.start()
        leaving.join(LOOP_WAIT_S + MARGIN_S + 5)
        took = time.monotonic() - start
        assert not leaving.is_alive(), f"shutdown had not returned {took:.1f} s after it was called"
        assert served["shutdown"] == "returned", served
        assert LOOP_WAIT_S <= took < LOOP_WAIT_S + MARGIN_S, took  # waited for the loop, then closed
        serving.join(5)
        assert not serving.is_alive()
        assert isinstance(served.get("error"), CollectivesClosed), served  # the stuck call was ended
        assert "was waiting for a peer when" in str(served["error"])
        assert loop.stops == 1 and worker._collectives is None and worker._loop is None
        with pytest.raises(CollectivesClosed):
            mine.all_reduce_sum_(torch.ones(8))
    finally:
        mine.close()  # ends a stuck call on the old code too, so its threads leave
        peers.close()
        serving.join(10)
        leaving.join(10)
        worker._compute.shutdown(wait=False)


def test_shutdown_after_the_loop_ended_releases_on_the_compute_thread_without_waiting(tmp_path, monkeypatch):
    """The usual shutdown: the loop ended (the driver stopped it); nothing is waited for, and the
    model, the collectives and the backend go on the thread that computes."""
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    mine, peers = thread_ranks(tmp_path, 2)
    worker = RayRankWorker(WorkerSpec(rank=0, world_size=2, backend="cpu", threads=1))
    released_on: list[str] = []

    class Backend:
        def shutdown(self) -> None:
            released_on.append(threading.current_thread().name)

    worker._collectives, worker._backend, worker._model = mine, Backend(), object()
    worker._serve_ended = threading.Event()
    worker._serve_ended.set()
    try:
        start = time.monotonic()
        worker.shutdown()
        assert time.monotonic() - start < 1.0
        assert worker._model is None and worker._collectives is None
        assert len(released_on) == 1 and released_on[0].startswith("corelaunch-compute"), released_on
        with pytest.raises(CollectivesClosed):
            mine.all_reduce_sum_(torch.ones(8))
    finally:
        mine.close()
        peers.close()
