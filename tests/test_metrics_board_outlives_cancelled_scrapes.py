"""A scrape's call to the metrics board is no child of the scrape's request, so Serve's proxy
cancelling a disconnected client's request (`ray.cancel(recursive=True)`) leaves it running.

Before the fix the sync /metrics route sent the board's `gather` from a thread that carried the
request's context, so the gather was the request's child. Through Serve, by hand (two replicas,
scrapes cut short by their clients), that left one replica's every later call to the board
unanswered: each scrape it answered waited 5 s and showed its series alone. This test shows the
cause, not that consequence (which needs Serve and a storm of cut scrapes): real Ray, the real
board class, busy on both of its threads so the scrape's gather waits in its queue (Ray cancels a
child queued at a threaded actor, where the test can see it), and an async actor that scrapes as
a Serve replica's route does (on a thread holding a copy of the request's context)."""

from __future__ import annotations

import asyncio
import time

import pytest

from launcher.serving.metrics_board import MetricsBoard

pytestmark = pytest.mark.slow  # an actor pair on the session's Ray (seconds)


class HeldBoard(MetricsBoard):
    """The board, recording the gathers that reach it, with a call that keeps its one thread busy."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: list[str] = []

    def gather(self, replica: str, text: bytes, rendered: int) -> dict[str, bytes]:
        self.gathered.append(replica)
        return super().gather(replica, text, rendered)

    def gathers(self) -> list[str]:
        return self.gathered

    def hold(self, seconds: float) -> None:
        time.sleep(seconds)


class GatherCounter:
    """The board's handle as the poster sees it, counting the gathers it has submitted (the periodic
    poster calls `put`), so the test cancels the scrape only once its gather is submitted: a loaded
    machine can take longer than any fixed wait between the render and the submission."""

    def __init__(self, board) -> None:
        self.board, self.submitted = board, 0

    def __getattr__(self, name):
        return getattr(self.board, name)

    @property
    def gather(self):
        return self

    def remote(self, *args):
        ref = self.board.gather.remote(*args)  # in the context the poster runs it in
        self.submitted += 1
        return ref


class ScrapingReplica:
    def __init__(self, board) -> None:
        from launcher.serving.metrics_board import BoardPoster

        self.counter = GatherCounter(board)
        self.poster = BoardPoster(self.counter, "r1", render=lambda: b"corelaunch_up 1.0\n")

    def gathers_submitted(self) -> int:
        return self.counter.submitted

    async def scrape(self) -> bytes:
        # Starlette runs a sync route in a thread with the request's context copied, as to_thread does
        return await asyncio.to_thread(self.poster.exposition)

    def close(self) -> None:
        self.poster.close()


def test_a_scrape_cancelled_with_its_request_still_posts_to_the_board(ray_session):
    ray = ray_session
    board = ray.remote(num_cpus=0, max_concurrency=2)(HeldBoard).remote()
    replica = ray.remote(num_cpus=0)(ScrapingReplica).remote(board)
    ray.get([board.__ray_ready__.remote(), replica.__ray_ready__.remote()], timeout=120)
    held = [board.hold.remote(8.0) for _ in range(2)]  # the scrape's gather queues behind them
    ref = replica.scrape.remote()
    deadline = time.monotonic() + 6
    while not ray.get(replica.gathers_submitted.remote(), timeout=30):
        assert time.monotonic() < deadline, "the scrape never submitted its gather"
        time.sleep(0.05)
    ray.cancel(ref, recursive=True)  # its gather waits in the board's queue
    try:  # cancelled; before the fix it could also end first, its own series alone, its gather cut
        ray.get(ref, timeout=30)
    except ray.exceptions.TaskCancelledError:
        pass
    ray.get(held, timeout=30)
    deadline = time.monotonic() + 10  # the gather and this read may run at once on the board's threads
    while not (gathered := ray.get(board.gathers.remote(), timeout=30)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gathered == ["r1"]  # it ran once the board was free
    ray.get(replica.close.remote(), timeout=30)
    ray.kill(replica)
    ray.kill(board)
