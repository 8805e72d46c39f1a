"""The choices of one OpenAI request (`n` of each of its prompts), one engine stream each, read as one stream of
(choice index, delta) in the order the deltas arrive. Closing it closes every engine stream, which
cancels the requests still running (a client that leaves takes all its choices with it)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Callable

_END = object()


async def _next(stream):
    """The stream's next delta, or _END (a task cannot end with StopAsyncIteration as its result)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


class ChoiceStreams:
    """Async iterator of (index, StreamDelta) over `streams` (Launcher.astream's, choice i at i).

    One stream is read directly, as the request would be without choices. Several are read by a
    task each, one delta at a time; an error in any one ends the whole (the caller closes it, which
    cancels the others)."""

    def __init__(self, streams: list, prompt_lengths: Sequence[int] = (), choices_per_prompt: int = 1,
                 on_cached: Callable[[int], None] | None = None) -> None:
        """prompt_lengths: each prompt's tokens, in order (streams i * choices_per_prompt onwards are
        prompt i's choices)."""
        self.streams = streams
        self._prompt_lengths = list(prompt_lengths)
        self.prompt_tokens = sum(self._prompt_lengths)
        """The request's prompt tokens, each prompt counted once whatever its choices (usage)."""
        self.cached_tokens = 0
        """Of those, the ones not prefilled (prefix caching): each prompt's first choice's count, once its
        first token came. on_cached(n) hears each such count as it comes."""
        self._choices_per_prompt, self._on_cached = choices_per_prompt, on_cached
        self._reads: dict[asyncio.Future, int] = {}
        self._ready: deque = deque()
        self._started = self._closed = False

    def choice_prompt_tokens(self, index: int) -> int:
        """The prompt tokens of choice `index`'s prompt (a chunk's usage with continuous_usage_stats)."""
        return self._prompt_lengths[index // self._choices_per_prompt]

    def prompt_context(self, index: int) -> list[int]:
        """The prompt's last ids choice `index`'s text was decoded after (its TextStream's), for its
        render to place the logprobs' tokens in that same text; [] for a stream without one."""
        text = getattr(self.streams[index], "text", None)
        return list(getattr(text, "prompt_context", []))

    def __aiter__(self) -> "ChoiceStreams":
        return self

    async def __anext__(self):
        index, delta = await self._next_delta()
        if delta.cached_tokens is not None and index % self._choices_per_prompt == 0:
            self.cached_tokens += delta.cached_tokens
            if self._on_cached is not None:
                self._on_cached(delta.cached_tokens)
        return index, delta

    async def _next_delta(self):
        if len(self.streams) == 1:
            return 0, await self.streams[0].__anext__()
        if self._closed:
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            self._reads = {asyncio.ensure_future(_next(s)): i for i, s in enumerate(self.streams)}
        while not self._ready:
            if not self._reads:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=self._reads.__getitem__):  # equal arrivals in choice order
                index = self._reads.pop(read)
                delta = read.result()  # an error ends the whole; close() cancels the other reads
                if delta is _END:
                    continue
                self._ready.append((index, delta))
                self._reads[asyncio.ensure_future(_next(self.streams[index]))] = index
        return self._ready.popleft()

    async def aclose(self) -> None:
        """Cancel the reads in flight (their requests are cancelled with them) and close every stream."""
        self._closed = True
        reads, self._reads = list(self._reads), {}
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)  # every error retrieved: none logged as lost
        for stream in self.streams:
            await stream.aclose()
