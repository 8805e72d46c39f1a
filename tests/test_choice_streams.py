"""The n choices of one OpenAI request read as one stream (launcher/serving/choice_streams.py):
every delta of every choice comes through once, in arrival order and each choice's in its own
order; an error in one choice ends the whole; closing cancels what is still running."""

from __future__ import annotations

import asyncio

import pytest

from launcher.serving.choice_streams import ChoiceStreams


class Delta(str):
    """A delta's text standing for the whole delta; cached_tokens as StreamDelta has it."""

    def __new__(cls, text: str, cached_tokens: int | None = None):
        delta = super().__new__(cls, text)
        delta.cached_tokens = cached_tokens
        return delta


class Stream:
    """An engine stream's surface (__anext__, aclose) giving `items` (text, or Delta) after `delay_s`
    each; an exception among them is raised when its turn comes."""

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
        return item if isinstance(item, Delta) else Delta(item)

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


def test_cached_prompt_tokens_count_each_prompts_first_choice_once():
    """Two prompts of two choices each (streams 0, 1 are prompt 0's): usage counts a prompt once,
    as its prompt tokens are counted, so only its first choice's count is taken."""
    heard = []

    async def run():
        streams = [Stream([Delta("a", 5), "b"], 0.0), Stream([Delta("c", 5)], 0.0),
                   Stream([Delta("d", 0)], 0.0), Stream([Delta("e", 3)], 0.0)]
        merged = ChoiceStreams(streams, prompt_lengths=[12, 8], choices_per_prompt=2, on_cached=heard.append)
        got = [pair async for pair in merged]
        await merged.aclose()
        return merged, got

    merged, got = asyncio.run(run())
    assert len(got) == 5 and merged.cached_tokens == 5 and sorted(heard) == [0, 5]
    # each prompt counted once; a choice's chunks name its own prompt's (continuous_usage_stats)
    assert merged.prompt_tokens == 20 and [merged.choice_prompt_tokens(i) for i in range(4)] == [12, 12, 8, 8]


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
