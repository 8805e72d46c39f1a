"""The n choices of one OpenAI request read as one stream (launcher/serving/choice_streams.py):
every delta of every choice comes through once, in arrival order and each choice's in its own
order; an error in one choice ends the whole; closing cancels what is still running."""

from __future__ import annotations

import asyncio

import pytest

from launcher.serving.choice_streams import ChoiceStreams


class Stream:
    """An engine stream's surface (__anext__, aclose) giving `items` after `delay_s` each; an
    exception among them is raised when its turn comes."""

    def __init__(self, items, delay_s: float):
        self.items, self.delay_s = list(items), delay_s
        self.closed = self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self):
        self.closed = True


def test_every_choice_delta_comes_once_in_arrival_order():
    async def run():
        streams = [Stream(["a1", "a2", "a3"], 0.03), Stream(["b1", "b2"], 0.01), Stream([], 0.0)]
        merged = ChoiceStreams(streams)
        got = [pair async for pair in merged]
        await merged.aclose()
        return got, streams

    got, streams = asyncio.run(run())
    assert sorted(got) == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1"), (1, "b2")]
    assert [d for i, d in got if i == 0] == ["a1", "a2", "a3"] and [d for i, d in got if i == 1] == ["b1", "b2"]
    assert got.index((1, "b2")) < got.index((0, "a2"))  # the faster choice is not held behind the slower
    assert all(s.closed for s in streams)


def test_one_stream_is_read_directly():
    async def run():
        merged = ChoiceStreams([Stream(["x", "y"], 0.0)])
        return [pair async for pair in merged]

    assert asyncio.run(run()) == [(0, "x"), (0, "y")]


def test_an_error_in_one_choice_ends_the_whole_and_closing_cancels_the_others():
    async def run():
        streams = [Stream(["a1", "a2"], 0.5), Stream(["b1", RuntimeError("choice 1 failed")], 0.01)]
        merged = ChoiceStreams(streams)
        got = []
        with pytest.raises(RuntimeError, match="choice 1 failed"):
            async for pair in merged:
                got.append(pair)
        await merged.aclose()
        return got, streams

    got, streams = asyncio.run(run())
    assert got == [(1, "b1")]
    assert streams[0].cancelled and all(s.closed for s in streams)  # the slow choice's read was cancelled


def test_closing_before_or_during_reading_closes_every_stream():
    async def run():
        unread = [Stream(["a"], 0.0), Stream(["b"], 0.0)]
        await ChoiceStreams(unread).aclose()  # never read (a client gone before the first token)
        reading = [Stream(["a1", "a2"], 0.01), Stream(["b1", "b2"], 1.0)]
        merged = ChoiceStreams(reading)
        first = await merged.__anext__()
        await merged.aclose()
        with pytest.raises(StopAsyncIteration):
            await merged.__anext__()
        return unread, reading, first

    unread, reading, first = asyncio.run(run())
    assert first == (0, "a1")
    assert all(s.closed for s in unread + reading) and reading[1].cancelled
