"""The iterators Launcher.stream and Launcher.astream return.

A request is validated and submitted when the iterator is made, not when it is first read, so bad
input and a full queue raise at the call. Closing the iterator early (close / aclose, leaving a
`with` / `async with` block, a `break` followed by garbage collection, an asyncio task cancelled
while it waits) cancels the request, which frees its cache row at the group's next iteration.

After a cancel, the reader that closed the stream reads its end quietly (StopIteration), as after a
generator's close(); any other reader, one blocked in a read at the time included, gets the reason
(RequestCancelled, or the RequestTimeout that cancelled it), never a quiet end it would take for a
finished stream.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import NoReturn

from launcher.cluster.stream_handle import StreamHandle
from launcher.errors import RequestCancelled, RequestTimeout
from launcher.serving.stream_types import StreamDelta
from launcher.serving.text_stream import TextStream, merged
from workers.serving.requests import TokenEvent

_GRACE_S = 30.0
"""Beyond the request's own deadline, how long a reader waits for the replica to report anything
(the replica's thread fails overdue requests itself; this only guards against that thread dying)."""


class _Stream:
    def __init__(self, cancel, handle: StreamHandle, text: TextStream, gather: int = 1) -> None:
        """gather: the request's stream_interval. Where the leader holds its tokens, its events come
        that many at a time already; where it sends each (a request with stop strings, which are
        matched here on every token), the deltas are joined here instead, by the same rule."""
        self._cancel, self.handle, self.text = cancel, handle, text
        self.gather = gather
        self._read_tokens = 0
        """Tokens in the deltas handed to the reader so far."""
        self.done = False
        self._closer = None
        """The thread or task that closed the stream: its later reads end quietly."""
        self._cancelled: BaseException | None = None
        """Why the stream was cancelled, for every other later read."""
        self.events: list[TokenEvent] = []
        """Every event read (generate() keeps their logits and step times)."""

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def _delta(self, item) -> StreamDelta:
        if isinstance(item, BaseException):
            self._fail(item)
        if item.finish_reason == "abort" and not self.handle.cancelled:
            # The group dropped a request its reader never cancelled (it is stopping): an error for
            # the reader, not an ending it would take for a finished answer ("abort" is no reason
            # a delta documents, nor one OpenAI's API knows).
            self._fail(RequestCancelled(f"request {self.request_id} was aborted by its TP group without being "
                                        f"cancelled (the group is stopping, or its leader refused the request), "
                                        f"after {len(self.handle.delivered)} token(s)"))
        self.events.append(item)
        delta = self.text.delta(item, self.handle.time_to_first_token_s)
        if delta.finish_reason is not None:
            self.done = True
            if self.text.stopped_by_string and item.finish_reason is None:
                self._cancel(self.handle)  # the group would go on generating: free its row now
        return delta

    def _due(self, last: StreamDelta, tokens: int) -> bool:
        """Whether the deltas read since the last one handed over (`tokens` tokens, ending with
        `last`) go out now (vLLM's stream_interval rule): the request ended, they hold its first
        token, or `gather` tokens have come."""
        return (last.finish_reason is not None or (self._read_tokens == 0 and tokens > 0)
                or tokens >= self.gather)

    def _handed(self, deltas: list[StreamDelta], tokens: int) -> StreamDelta:
        """The delta the reader gets for `deltas` (their parts kept, one token each)."""
        self._read_tokens += tokens
        if len(deltas) == 1:
            return deltas[0]
        return merged([part for d in deltas for part in d.parts or (d,)])

    def _deferred(self, error: Exception) -> None:
        """A read failed after some deltas were gathered: they go to the reader first, and `error` ends
        the stream, raised by the next read whoever makes it (a failure that did not end the stream
        itself, the text's or a cancel's, cancels the request too)."""
        if self._cancelled is None:
            self._cancelled = error
        if not self.handle.finished:
            self.done = True
            try:
                self._cancel(self.handle)
            except Exception:  # noqa: BLE001 - the reader gets `error`; the replica's own checks end the request
                pass
        self.done = True

    def _fail(self, error: BaseException) -> NoReturn:
        """End the stream with `error`, for this read and every later one, whichever reader makes it
        (another thread's reader took the end for a finished answer)."""
        if self._cancelled is None:  # before `done`: a reader that sees it done finds the reason
            self._cancelled = error
        self.done = True
        raise error

    def _overdue(self) -> RequestTimeout:
        """A LaunchError, as the replica's own timeout is (the CLI names it in one line, not a traceback)."""
        return RequestTimeout(f"request {self.request_id} got no answer within {self.handle.timeout_s + _GRACE_S:g} s "
                              f"(its request timeout plus {_GRACE_S:g} s: its replica reported nothing, not even "
                              f"that it timed out, as while it restarts a group); see replica_status() and the "
                              f"worker logs (ray logs), or raise request_timeout_s (--request-timeout) for long "
                              f"generations")

    def cancel(self, deferred: bool = False, reason: BaseException | None = None) -> bool:
        """Cancel the request. With a `reason`, it first ends the request's events, waking a reader
        blocked meanwhile in another thread or task (the sink takes it like any event, from any
        thread); a request that had finished is left alone (False), its last events still to read."""
        if self.done:
            return False
        if reason is not None and not self.handle.fail(reason):
            return False
        self.done = True
        self._cancelled = reason
        self._cancel(self.handle, deferred)
        return True

    def _close(self, closer, by: str) -> None:
        """Cancel for `closer` (the calling thread or task), whose later reads then end quietly."""
        reason = RequestCancelled(f"request {self.request_id} was closed ({by}) by another reader of its stream, "
                                  f"after {len(self.handle.delivered)} token(s)")
        if self.cancel(reason=reason):
            self._closer = closer

    def _ended(self, reader) -> None:
        """A read after the end: raise the reason unless `reader` closed the stream itself."""
        if self._cancelled is not None and reader != self._closer:
            raise self._cancelled.with_traceback(None)  # raised again per read: no traceback piling up

    def __del__(self) -> None:
        # A finalizer runs in whichever thread the garbage collector happens to run in, possibly
        # one holding the replica's locks: it only leaves the cancel for the replica's thread.
        try:
            self.cancel(deferred=True)
        except Exception:  # noqa: BLE001 - at interpreter exit the launcher may be gone already
            pass


class RequestStream(_Stream):
    """Iterator of StreamDelta; the last has finish_reason set."""

    def __init__(self, cancel, handle: StreamHandle, text: TextStream, items: queue.Queue, gather: int = 1) -> None:
        super().__init__(cancel, handle, text, gather)
        self._items = items

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamDelta:
        if self.done:
            self._ended(threading.get_ident())
            raise StopIteration
        if self.gather == 1:
            return self._next_delta()
        deltas: list[StreamDelta] = []
        tokens = 0
        while not deltas or not self._due(deltas[-1], tokens):
            try:
                deltas.append(self._next_delta())
            except Exception as err:
                if not deltas:
                    raise
                self._deferred(err)
                break
            tokens += len(deltas[-1].token_ids)
        return self._handed(deltas, tokens)

    def _next_delta(self) -> StreamDelta:
        try:
            item = self._items.get(timeout=self.handle.timeout_s + _GRACE_S)
        except queue.Empty:
            overdue = self._overdue()
            self.cancel(reason=overdue)
            raise overdue from None
        except KeyboardInterrupt:  # Ctrl-C while waiting for a token: the request goes too, as in generate()
            self.cancel(reason=RequestCancelled(f"request {self.request_id} was cancelled by Ctrl-C"))
            raise
        return self._delta(item)

    def close(self) -> None:
        self._close(threading.get_ident(), "close()")

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRequestStream(_Stream):
    """Async iterator of StreamDelta; the last has finish_reason set."""

    def __init__(self, cancel, handle: StreamHandle, text: TextStream, items: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop | None = None, gather: int = 1) -> None:
        super().__init__(cancel, handle, text, gather)
        self._items = items
        self._loop = loop
        """The event loop its events are handed to (the one astream() was called on)."""

    def __aiter__(self) -> "AsyncRequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self._loop is not None and asyncio.get_running_loop() is not self._loop and not self.done:
            # Its events go to the other loop's queue: this read would wait out the request timeout.
            wrong = RuntimeError(f"request {self.request_id}'s stream is fed on the event loop astream() was called "
                                 f"on, not on this one; call astream() in the loop that reads the stream")
            self.cancel(reason=wrong)
            raise wrong
        if self.done:
            self._ended(asyncio.current_task())
            raise StopAsyncIteration
        if self.gather == 1:
            return await self._next_delta()
        deltas: list[StreamDelta] = []
        tokens = 0
        while not deltas or not self._due(deltas[-1], tokens):
            try:
                deltas.append(await self._next_delta())
            except Exception as err:
                if not deltas:
                    raise
                self._deferred(err)
                break
            tokens += len(deltas[-1].token_ids)
        return self._handed(deltas, tokens)

    async def _next_delta(self) -> StreamDelta:
        try:
            item = await next_item(self._items, self.handle.timeout_s + _GRACE_S)
        except asyncio.TimeoutError:
            overdue = self._overdue()
            self.cancel(reason=overdue)
            raise overdue from None
        except asyncio.CancelledError:
            # the task reading this stream was cancelled (a client went away, asyncio.wait_for's timeout)
            self.cancel(reason=RequestCancelled(f"request {self.request_id} was cancelled when the task reading "
                                                f"its stream was cancelled (asyncio.wait_for's timeout cancels it)"))
            raise
        return self._delta(item)

    async def aclose(self) -> None:
        self._close(asyncio.current_task(), "aclose()")

    async def __aenter__(self) -> "AsyncRequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def thread_sink(items: queue.Queue):
    return items.put


async def _get_within(items: asyncio.Queue, timeout_s: float):
    async with asyncio.timeout(timeout_s):  # one timer armed, no task of its own (as wait_for makes)
        return await items.get()


async def next_item(items: asyncio.Queue, timeout_s: float):
    """The queue's next item, at once when one is there, else awaited for at most timeout_s
    (asyncio.TimeoutError past it). A server awaits this once per streamed token, so neither way
    wraps the get in a task where Python lets it avoid one."""
    try:
        return items.get_nowait()
    except asyncio.QueueEmpty:
        return await _get_within(items, timeout_s)
