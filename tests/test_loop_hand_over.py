"""How a replica's thread hands streamed events to an event loop (launcher/serving/loop_hand_over.py):
in order, per stream, and in one wake-up of the loop for a burst of events across its streams."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from launcher.serving.loop_hand_over import loop_sink
from launcher.serving.request_streams import next_item


class CountingLoop(asyncio.SelectorEventLoop):
    """A real selector loop that counts the calls other threads schedule on it."""

    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def run_on(loop: asyncio.AbstractEventLoop, coroutine):
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def test_a_burst_from_another_thread_wakes_the_loop_once_and_keeps_each_streams_order():
    loop = CountingLoop()

    async def scenario():
        queues = [asyncio.Queue() for _ in range(4)]
        sinks = [loop_sink(q, loop) for q in queues]

        def one_step(step: int) -> None:  # what a replica's poll does: one event per stream
            for stream, sink in enumerate(sinks):
                sink((step, stream))

        for step in range(3):
            # The loop is held in this coroutine while the thread delivers, as when it is busy
            # writing the previous step's events: the whole step must join one hand-over.
            thread = threading.Thread(target=one_step, args=(step,))
            thread.start()
            thread.join()
            await asyncio.sleep(0)  # the hand-over runs
            assert [q.qsize() for q in queues] == [step + 1] * 4
        assert loop.threadsafe_calls == 3  # one per step, not one per event
        return [[q.get_nowait() for _ in range(3)] for q in queues]

    got = run_on(loop, scenario())
    assert got == [[(step, stream) for step in range(3)] for stream in range(4)]


def test_events_put_while_a_hand_over_is_pending_arrive_after_the_earlier_ones():
    loop = asyncio.new_event_loop()

    async def scenario():
        items = asyncio.Queue()
        sink = loop_sink(items, loop)
        sink("a")  # schedules the hand-over
        sink("b")  # joins it
        await asyncio.sleep(0)
        sink("c")  # a new batch
        await asyncio.sleep(0)
        return [items.get_nowait() for _ in range(3)]

    assert run_on(loop, scenario()) == ["a", "b", "c"]


def test_putting_into_a_closed_loop_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    sink = loop_sink(asyncio.Queue(), loop)
    loop.close()
    sink("late")  # nobody is left to read: no error on the replica's thread
    sink("later")


def test_a_closed_loop_is_freed_even_after_an_event_arrived_too_late_for_it():
    import weakref

    loop = asyncio.new_event_loop()
    items = asyncio.Queue()
    sink = loop_sink(items, loop)

    async def reader():  # binds the queue to the loop, as a Serve reader's does
        return await items.get()

    task = loop.create_task(reader())
    loop.call_soon(task.cancel)  # the reader goes away, as when a client disconnects
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(task)
    sink("scheduled, then dropped by the close")
    loop.close()
    sink("late")  # the replica's thread had not yet seen the cancel
    gone = weakref.ref(loop)
    del loop, task, items, sink  # the replica drops its handle (and the sink) when the stream ends
    gc.collect()
    assert gone() is None


def test_waiting_for_an_item_is_bounded():
    loop = asyncio.new_event_loop()

    async def scenario():
        items = asyncio.Queue()
        with pytest.raises(asyncio.TimeoutError):
            await next_item(items, 0.05)
        items.put_nowait("x")
        return await next_item(items, 1.0)

    assert run_on(loop, scenario()) == "x"


def test_the_hand_over_benchmark_runs_both_ways_and_refuses_bad_counts(capsys):
    import json

    from benchmarks.loop_hand_over import main

    report = main(["--streams", "3", "--steps", "5", "--step-ms", "0", "--rounds", "1"])
    assert json.loads(capsys.readouterr().out) == report
    assert set(report["cpu_us_per_step"]) == {"batched", "per_item"}
    assert all(len(values) == 1 and values[0] > 0 for values in report["cpu_us_per_step"].values())
    with pytest.raises(SystemExit):
        main(["--streams", "0"])
    assert "--streams (0) must be >= 1" in capsys.readouterr().err
