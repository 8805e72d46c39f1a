"""A rank's shutdown tells its compute thread's own failure from its own wait running out: with
Python 3.11 a future's result(timeout=) raises the builtin TimeoutError for both, so a release that
failed with a TimeoutError was reported as "still busy 5 s after the serving loop was stopped"
at once. The actor class is used as a plain object (Ray's wrapping is not what is tested)."""

from __future__ import annotations

import sys
import time

import pytest


def test_a_release_failing_with_its_own_timeout_error_is_not_named_a_busy_compute_thread(monkeypatch):
    from launcher.cluster.ray_worker import RayRankWorker
    from workers.rank_worker import WorkerSpec

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the worker points it at stderr, as in its process
    worker = RayRankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1))

    def release():
        raise TimeoutError("the backend's own shutdown timed out")

    monkeypatch.setattr(worker, "_release", release)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        worker.shutdown()
    assert str(raised.value) == "the backend's own shutdown timed out"
    assert time.monotonic() - start < 5.0  # it did not wait out SHUTDOWN_RELEASE_WAIT_S either
