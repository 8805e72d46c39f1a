"""An astream kept past the end of its event loop (asyncio.run closes async generators at its end,
and a stream is not one) ran on to max_tokens holding its cache row, though nothing could read it:
its sink now says no reader is left, and the replica cancels it as it cancels a dropped stream.
(Found with the built-in model: a kept astream's row stayed running for as long as it was watched,
6 s, tokens still arriving.)"""

from __future__ import annotations

import asyncio

from launcher.cluster.stream_handle import StreamHandle
from launcher.serving.loop_hand_over import loop_sink
from tests.serving_driver import request
from tests.test_replica_pool import TIMEOUT_S, make_pool  # noqa: F401 - make_pool is a fixture
from workers.serving.requests import TokenEvent


def a_stream_on(pool, loop) -> tuple[StreamHandle, object]:
    """A stream fed through loop_sink onto `loop`, submitted, whose group then produces one token."""
    handle = StreamHandle(request("s", [1, 2], 8), loop_sink(asyncio.Queue(), loop), TIMEOUT_S)
    pool.submit_streams([handle], rows=1)
    group = pool.replicas[0].started.group
    pending = [[TokenEvent("s", [5])]]
    group.poll = lambda wait_s: (pending.pop() if pending else [], {}, {})
    return handle, group


def test_a_stream_whose_event_loop_has_closed_is_cancelled_at_its_next_token(make_pool):
    pool = make_pool(1)
    pool.start()
    loop = asyncio.new_event_loop()
    loop.close()  # as asyncio.run leaves it
    handle, group = a_stream_on(pool, loop)
    replica = pool.replicas[0]  # its thread serves no streams (the scripted group is not a serving one)
    replica._poll_streams(wait_s=0)  # the token: delivered, and its sink says nobody reads it
    assert handle.unread and handle.delivered == [5] and group.cancelled == []
    replica._poll_streams(wait_s=0)  # the next poll cancels it, as a dropped stream
    assert group.cancelled == [["s"]] and "s" not in replica.streams


def test_a_stream_whose_loop_is_open_is_not_cancelled(make_pool):
    pool = make_pool(1)
    pool.start()
    loop = asyncio.new_event_loop()
    try:
        handle, group = a_stream_on(pool, loop)
        pool.replicas[0]._poll_streams(wait_s=0)
        pool.replicas[0]._poll_streams(wait_s=0)  # a poll after it: a cancel would be sent by now
        assert handle.delivered == [5] and not handle.unread and group.cancelled == [] and "s" in pool.replicas[0].streams
    finally:
        loop.close()


def test_a_request_that_races_the_shutdown_is_told_the_same_launcher_starts_again(make_pool):
    """It said "start a new one", though the same Launcher starts again once shutdown() returns."""
    import pytest

    from launcher.errors import LaunchError

    pool = make_pool(1)
    pool.start()
    pool.shutdown(grace_s=1)
    with pytest.raises(LaunchError, match=r"shut down \(or shutting down\); call start\(\) again .* once shutdown\(\) "
                                          r"has returned"):
        pool.submit_streams([StreamHandle(request("late", [1, 2], 8), lambda event: None, TIMEOUT_S)], rows=1)
