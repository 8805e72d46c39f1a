"""A TP group's submits and cancels reach rank 0 even when the Ray task that asked for them is
cancelled recursively, as Ray Serve's proxy cancels a request whose client disconnected.

Before the fix the calls were sent from the request's own task, so Ray counted them as its
children: one still queued behind rank 0's busy threads was cancelled with the request, rank 0
waited for its number for good, and the replica answered nothing more (a client closing a stream
early behind the proxy, with two replicas, hung a replica in two runs of two). Real Ray: a
recording actor stands in for rank 0, with every thread busy, and an async actor holds the group
as a Serve replica does."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

pytestmark = pytest.mark.slow  # a Ray actor pair on the session's Ray (seconds)


class RecordingRank0:
    """Rank 0's two numbered methods, recording what reaches it; `hold` keeps a thread busy until the
    test releases it (rank 0's serving loop holds one of its threads for good)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list, int]] = []

    def hold(self, started_flag: str, release_flag: str, timeout_s: float = 60.0) -> None:
        open(started_flag, "w").close()
        # a file, not an actor call: every thread of this actor is busy here, so no call could end it
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(release_flag) and time.monotonic() < deadline:
            time.sleep(0.05)

    def submit_requests(self, requests, number: int) -> None:
        self.calls.append(("submit", requests, number))

    def cancel_requests(self, request_ids, number: int) -> None:
        self.calls.append(("cancel", request_ids, number))

    def seen(self) -> list:
        return self.calls


class ReplicaHoldingAGroup:
    """What a Serve replica does with its group: asks for a submit and a cancel inside a request."""

    def __init__(self, rank0) -> None:
        from launcher.cluster.resources import RankResources
        from launcher.cluster.tp_group import TPGroup

        self.group = TPGroup(tp_degree=1, backend="cpu", resources=RankResources(bundle={"CPU": 1}, num_cpus=1,
                                                                                  threads=1))
        self.group.actors = [rank0]

    async def request(self, request_id: str) -> None:
        self.group.submit([request_id])
        self.group.cancel([request_id])  # as a stream closed by its reader
        await asyncio.sleep(60)  # the client is still there; the proxy then cancels the request

    async def calls_handed_to_ray(self) -> int:
        # TPGroup numbers a call only once its .remote() returned (TPGroup._send_numbered)
        return self.group._next_call


def test_a_recursively_cancelled_request_still_delivers_its_group_calls(ray_session, tmp_path):
    ray = ray_session
    rank0 = ray.remote(num_cpus=0, max_concurrency=2)(RecordingRank0).remote()
    replica = ray.remote(num_cpus=0)(ReplicaHoldingAGroup).remote(rank0)
    release_flag = str(tmp_path / "release")
    try:
        ray.get(rank0.seen.remote(), timeout=60)  # started: the holds below are the first calls it runs
        started = [tmp_path / f"started-{n}" for n in range(2)]
        # both threads: the group's calls queue behind them
        held = [rank0.hold.remote(str(flag), release_flag) for flag in started]
        deadline = time.monotonic() + 60
        while not all(flag.exists() for flag in started):
            assert time.monotonic() < deadline, "rank 0 never ran both holds"
            time.sleep(0.05)
        ref = replica.request.remote("r1")
        # cancelled only once both calls are in rank 0's queue: a fixed sleep let a loaded host cancel
        # the request before it had asked for them, and nothing was recorded
        deadline = time.monotonic() + 60
        while ray.get(replica.calls_handed_to_ray.remote(), timeout=60) < 2:
            assert time.monotonic() < deadline, "the replica never handed its two calls to Ray"
            time.sleep(0.05)
        ray.cancel(ref, recursive=True)
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(ref, timeout=30)
        open(release_flag, "w").close()
        ray.get(held, timeout=30)
        deadline = time.monotonic() + 30
        while len(calls := ray.get(rank0.seen.remote(), timeout=30)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(calls, key=lambda c: c[2]) == [("submit", ["r1"], 0), ("cancel", ["r1"], 1)], calls
    finally:
        open(release_flag, "w").close()  # a failed check leaves no hold waiting for its timeout
        ray.kill(replica)
        ray.kill(rank0)
