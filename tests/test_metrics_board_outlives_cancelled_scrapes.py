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
import threading
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


class ScrapingReplica:
    def __init__(self, board) -> None:
        from launcher.serving.metrics_board import BoardPoster

        self.scrape_renders = 0
        self.poster = BoardPoster(board, "r1", render=self._render)

    def _render(self) -> bytes:
        if threading.current_thread().name != "corelaunch-metrics-board":  # not the periodic poster
            self.scrape_renders += 1  # the scrape sends its gather right after
        return b"corelaunch_up 1.0\n"

    def renders_by_scrapes(self) -> int:
        return self.scrape_renders

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
    held = [board.hold.remote(6.0) for _ in range(2)]  # the scrape's gather queues behind them
    ref = replica.scrape.remote()
    deadline = time.monotonic() + 5
    while not ray.get(replica.renders_by_scrapes.remote(), timeout=30):
        assert time.monotonic() < deadline, "the scrape never rendered"
        time.sleep(0.05)
    time.sleep(0.5)  # its gather, sent right after the render, waits in the board's queue
    ray.cancel(ref, recursive=True)
    try:  # cancelled; before the fix it could also end first, its own series alone, its gather cut
        ray.get(ref, timeout=30)
    except ray.exceptions.TaskCancelledError:
        pass
    ray.get(held, timeout=30)
    assert ray.get(board.gathers.remote(), timeout=30) == ["r1"]  # it ran once the board was free
    ray.get(replica.close.remote(), timeout=30)
    ray.kill(replica)
    ray.kill(board)
