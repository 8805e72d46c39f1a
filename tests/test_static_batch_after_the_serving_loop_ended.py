"""A static batch numbered for a group's serving loop (static_id) is refused once that loop has
ended, never run eagerly instead (workers/rank_worker.py RankWorker.generate and
launcher/cluster/ray_worker.py): run on the actor's thread, its collectives waited on ranks whose
loops had ended until the driver's request timeout. The loop may end between the actor's look at
it and RankWorker's: the ranks refuse then too. No Ray, no model."""

from __future__ import annotations

import sys
from concurrent.futures import Future

import pytest

from launcher.cluster.ray_worker import RayRankWorker
from workers.rank_worker import RankWorker, WorkerSpec

SPEC = WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1)


class EndingLoop:
    """A serving loop seen running at the first look, ended (serve() cleared it) at every later one."""

    def static(self, static_id, request):  # as an ended ServingLoop's: the batch never ran
        future = Future()
        future.set_exception(RuntimeError(f"static batch {static_id} never ran: the serving loop ended"))
        return future


class LoopEndsAfterFirstLook(RayRankWorker):
    looks = 0

    @property
    def _loop(self):
        self.looks += 1
        return EndingLoop() if self.looks == 1 else None

    @_loop.setter
    def _loop(self, value):  # RankWorker's __init__ sets it; this loop is the test's
        pass


def eager_batches(monkeypatch, worker) -> list:
    ran: list = []
    monkeypatch.setattr(worker, "_run_batch", lambda request: ran.append(request) or ["outputs"])
    worker._model = object()  # loaded
    return ran


def test_a_numbered_batch_is_refused_when_the_loop_has_ended(monkeypatch):
    worker = RankWorker(SPEC)
    ran = eager_batches(monkeypatch, worker)
    with pytest.raises(RuntimeError, match="serving loop ended before static batch 7 ran"):
        worker.generate("request", static_id=7)
    assert ran == []
    assert worker.generate("request") == ["outputs"] and ran == ["request"]  # an unnumbered one still runs


def test_a_loop_that_ends_between_the_actors_look_and_the_ranks_runs_no_batch(monkeypatch):
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # RayRankWorker sends stdout to stderr: restored after
    worker = LoopEndsAfterFirstLook(SPEC)
    try:
        ran = eager_batches(monkeypatch, worker)
        with pytest.raises(RuntimeError, match="static batch 3"):  # whichever look saw the loop end
            worker.generate("request", static_id=3)
        assert ran == []  # never run eagerly, on the actor's thread
    finally:
        worker._compute.shutdown(wait=False)
