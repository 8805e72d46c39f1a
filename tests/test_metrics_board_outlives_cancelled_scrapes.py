"""A scrape's call to the metrics board is no child of the scrape's request, so Serve's proxy
cancelling a disconnected client's request (`ray.cancel(recursive=True)`) leaves it running.

Before the fix the sync /metrics route sent the board's `gather` from a thread that carried the
request's context: with two replicas behind the proxy, scrapes cut short by their clients cancelled
such calls, and from then on every call of that replica's to the board went unanswered (each scrape
waited 5 s and showed one replica's series). Real Ray: the real board, busy with a slow call so the
scrape's gather waits in its queue, and an async actor that scrapes as a Serve replica's route does
(on a thread holding a copy of the request's context)."""

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


class ScrapingReplica:
    def __init__(self, board) -> None:
        from launcher.serving.metrics_board import BoardPoster

        self.poster = BoardPoster(board, "r1", render=lambda: b"corelaunch_up 1.0\n")

    async def scrape(self) -> bytes:
        # Starlette runs a sync route in a thread with the request's context copied, as to_thread does
        return await asyncio.to_thread(self.poster.exposition)

    def close(self) -> None:
        self.poster.close()


def test_a_scrape_cancelled_with_its_request_still_posts_to_the_board(ray_session):
    ray = ray_session
    # Two threads, both held: Ray cancels a child queued at a threaded actor, which the test can see
    # at once. At the real board (one thread) the same child relation broke the replica's later calls.
    board = ray.remote(num_cpus=0, max_concurrency=2)(HeldBoard).remote()
    replica = ray.remote(num_cpus=0)(ScrapingReplica).remote(board)
    held = [board.hold.remote(4.0) for _ in range(2)]  # the scrape's gather queues behind them
    ref = replica.scrape.remote()
    time.sleep(1.5)  # the scrape has sent its gather, which waits in the board's queue
    ray.cancel(ref, recursive=True)
    try:  # cancelled; before the fix it could also end first, its own series alone, its gather cut
        ray.get(ref, timeout=30)
    except ray.exceptions.TaskCancelledError:
        pass
    ray.get(held, timeout=30)
    assert ray.get(board.gathers.remote(), timeout=30) == ["r1"]  # it ran once the board was free
    started = time.monotonic()
    scraped = ray.get(replica.scrape.remote(), timeout=30)  # and the next scrape is answered at once
    assert b'corelaunch_up{replica="r1"} 1.0' in scraped and time.monotonic() - started < 3.0, scraped
    ray.get(replica.close.remote(), timeout=30)
    ray.kill(replica)
    ray.kill(board)
