"""The iterators Launcher.stream and Launcher.astream return.

A request is validated and submitted when the iterator is made, not when it is first read, so bad
input and a full queue raise at the call. Closing the iterator early (close / aclose, a `break`
followed by garbage collection, an asyncio task cancelled while it waits) cancels the request,
which frees its cache row at the group's next iteration.
"""

from __future__ import annotations

import asyncio
import queue
import sys

from launcher.cluster.stream_handle import StreamHandle
from launcher.errors import RequestTimeout
from launcher.serving.stream_types import StreamDelta
from launcher.serving.text_stream import TextStream
from workers.serving.requests import TokenEvent

_GRACE_S = 30.0
"""Beyond the request's own deadline, how long a reader waits for the replica to report anything
(the replica's thread fails overdue requests itself; this only guards against that thread dying)."""


class _Stream:
    def __init__(self, cancel, handle: StreamHandle, text: TextStream) -> None:
        self._cancel, self.handle, self.text = cancel, handle, text
        self.done = False
        self.events: list[TokenEvent] = []
        """Every event read (generate() keeps their logits and step times)."""

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def _delta(self, item) -> StreamDelta:
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.events.append(item)
        delta = self.text.delta(item, self.handle.time_to_first_token_s)
        if delta.finish_reason is not None:
            self.done = True
            if self.text.stopped_by_string and item.finish_reason is None:
                self._cancel(self.handle)  # the group would go on generating: free its row now
        return delta

    def _overdue(self) -> RequestTimeout:
        """A LaunchError, as the replica's own timeout is (the CLI names it in one line, not a traceback)."""
        return RequestTimeout(f"request {self.request_id} got no answer within {self.handle.timeout_s + _GRACE_S:g} s "
                              f"(its request timeout plus {_GRACE_S:g} s: its replica reported nothing, not even "
                              f"that it timed out, as while it restarts a group); see replica_status() and the "
                              f"worker logs (ray logs), or raise request_timeout_s (--request-timeout) for long "
                              f"generations")

    def cancel(self, deferred: bool = False) -> None:
        if not self.done:
            self.done = True
            self._cancel(self.handle, deferred)

    def __del__(self) -> None:
        # A finalizer runs in whichever thread the garbage collector happens to run in, possibly
        # one holding the replica's locks: it only leaves the cancel for the replica's thread.
        try:
            self.cancel(deferred=True)
        except Exception:  # noqa: BLE001 - at interpreter exit the launcher may be gone already
            pass


class RequestStream(_Stream):
    """Iterator of StreamDelta; the last has finish_reason set."""

    def __init__(self, cancel, handle: StreamHandle, text: TextStream, items: queue.Queue) -> None:
        super().__init__(cancel, handle, text)
        self._items = items

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamDelta:
        if self.done:
            raise StopIteration
        try:
            item = self._items.get(timeout=self.handle.timeout_s + _GRACE_S)
        except queue.Empty:
            self.cancel()
            raise self._overdue() from None
        except KeyboardInterrupt:  # Ctrl-C while waiting for a token: the request goes too, as in generate()
            self.cancel()
            raise
        return self._delta(item)

    def close(self) -> None:
        self.cancel()


class AsyncRequestStream(_Stream):
    """Async iterator of StreamDelta; the last has finish_reason set."""

    def __init__(self, cancel, handle: StreamHandle, text: TextStream, items: asyncio.Queue) -> None:
        super().__init__(cancel, handle, text)
        self._items = items

    def __aiter__(self) -> "AsyncRequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await next_item(self._items, self.handle.timeout_s + _GRACE_S)
        except asyncio.TimeoutError:
            self.cancel()
            raise self._overdue() from None
        except asyncio.CancelledError:
            self.cancel()  # the task reading this stream was cancelled (a client went away)
            raise
        return self._delta(item)

    async def aclose(self) -> None:
        self.cancel()


def thread_sink(items: queue.Queue):
    return items.put


if sys.version_info >= (3, 11):
    async def _get_within(items: asyncio.Queue, timeout_s: float):
        async with asyncio.timeout(timeout_s):  # one timer armed
            return await items.get()
else:
    async def _get_within(items: asyncio.Queue, timeout_s: float):
        return await asyncio.wait_for(items.get(), timeout_s)  # all 3.10 has: a task of its own


async def next_item(items: asyncio.Queue, timeout_s: float):
    """The queue's next item, at once when one is there, else awaited for at most timeout_s
    (asyncio.TimeoutError past it). A server awaits this once per streamed token, so neither way
    wraps the get in a task where Python lets it avoid one."""
    try:
        return items.get_nowait()
    except asyncio.QueueEmpty:
        return await _get_within(items, timeout_s)
