"""The iterators Launcher.stream and Launcher.astream return.

A request is validated and submitted when the iterator is made, not when it is first read, so bad
input and a full queue raise at the call. Closing the iterator early (close / aclose, leaving a
`with` / `async with` block, a `break` followed by garbage collection, an asyncio task cancelled
while it waits) cancels the request, which frees its cache row at the group's next iteration.

After a cancel, the reader that closed the stream reads its end quietly (StopIteration), as after a
generator's close(); any other reader, one blocked in a read at the time included, gets the reason
(RequestCancelled, or the RequestTimeout that cancelled it), never a quiet end it would take for a
finished stream.

A stream of a request with stop strings gathers its deltas here (`gather`, its stream_interval):
its leader sends each token, so that the stop strings, matched here, end it at the token that
completes one. So does a stream whose interval is above what a leader holds (MOST_HELD): it takes
the leader's events a token at a time, so each delta after the first holds exactly the interval.
A read that fails after some deltas were gathered hands those over first, and the next read raises
the failure. So does one that fails while text is held back (the start of what may be a stop string,
or of a character): the reader gets the text of every token it was handed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
import time
from typing import NoReturn

from launcher.cluster.stream_handle import StreamHandle
from launcher.errors import RequestCancelled, RequestTimeout
from launcher.serving.stream_types import StreamDelta
from launcher.serving.text_stream import TextStream, merged
from workers.serving.requests import TokenEvent

_GRACE_S = 30.0
"""Beyond the request's own deadline, how long a reader waits for the replica to report anything
(the replica's thread fails overdue requests itself; this only guards against that thread dying)."""


def _wait_s(handle: StreamHandle) -> float:
    """How long a read waits for the request's next event: until _GRACE_S past its deadline."""
    return max(handle.deadline - time.monotonic(), 0.0) + _GRACE_S


class _Stream:
    def __init__(self, cancel, handle: StreamHandle, text: TextStream, gather: int = 1) -> None:
        """gather: tokens the stream joins into one delta: the request's stream_interval where its
        leader sends each token (a request with stop strings) or holds fewer than it (an interval
        above MOST_HELD: workers.serving.held_tokens.held_per_event), 1 where the leader holds them
        all itself (Launcher._new_stream)."""
        self._cancel, self.handle, self.text = cancel, handle, text
        self.gather = gather
        self._gathered: list[StreamDelta] = []
        """Deltas read and not handed over yet (gather > 1)."""
        self._gathered_tokens = 0
        self._carried: collections.deque[StreamDelta] = collections.deque()
        """One-token parts of a read delta that are past the delta last handed over (gather > 1)."""
        self._handed_a_token = False
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
            self._fail_after_held(item)
        if item.finish_reason == "abort" and not self.handle.cancelled:
            # The group dropped a request its reader never cancelled (it is stopping): an error for
            # the reader, not an ending it would take for a finished answer ("abort" is no reason
            # a delta documents, nor one OpenAI's API knows).
            self._fail_after_held(RequestCancelled(
                f"request {self.request_id} was aborted by its TP group without being cancelled (the group is "
                f"stopping, or its leader refused the request), after {len(self.handle.delivered)} token(s)"))
        self.events.append(item)
        try:
            delta = self.text.delta(item, self.handle.time_to_first_token_s)
            if delta.finish_reason is not None:
                self.done = True
                if self.text.stopped_by_string and item.finish_reason is None:
                    self._cancel(self.handle)  # the group would go on generating: free its row now
        except Exception as err:  # the text's or the cancel's own failure ends the stream, and the request
            if not self.handle.finished:
                with contextlib.suppress(Exception):  # the reader gets `err`; the replica's checks end it
                    self._cancel(self.handle)
            self._fail(err)
        return delta

    def _carried_due(self) -> StreamDelta | None:
        """Gather the read deltas' one-token parts; the delta to hand over once due (vLLM's
        stream_interval rule: the request ended, the gathered deltas hold its first token, or
        `gather` tokens have come), else None. Parts past a due delta stay in _carried for the next
        read."""
        while self._carried:
            part = self._carried.popleft()
            self._gathered.append(part)
            self._gathered_tokens += len(part.token_ids)
            tokens = self._gathered_tokens
            if part.finish_reason is not None or (tokens and not self._handed_a_token) or tokens >= self.gather:
                return self._handed()
        return None

    def _after_failure(self, error: Exception) -> StreamDelta:
        """A read failed, which ended the stream: what was gathered before goes to the reader first,
        and the next read raises `error`; with nothing gathered, it is raised now."""
        if not self._gathered:
            raise error
        return self._handed()

    def _handed(self) -> StreamDelta:
        deltas, self._gathered = self._gathered, []
        self._handed_a_token = self._handed_a_token or self._gathered_tokens > 0
        self._gathered_tokens = 0
        return merged(deltas)

    def _fail_after_held(self, error: BaseException) -> NoReturn:
        """_fail, with the text held back so far (TextStream.held_delta) gathered first: the read
        hands it over (_after_failure) and the next one raises `error`."""
        self._gather_held()
        self._fail(error)

    def _gather_held(self) -> None:
        """The text held back so far, gathered for the failing read to hand over first."""
        held = self.text.held_delta()
        if held is not None:
            self._gathered.append(held)

    def _fail(self, error: BaseException) -> NoReturn:
        """End the stream with `error`, for this read and every later one, whichever reader makes it
        (another thread's reader took the end for a finished answer)."""
        if self._cancelled is None:  # before `done`: a reader that sees it done finds the reason
            self._cancelled = error
        self.done = True
        raise error

    def _overdue(self, waited_s: float) -> RequestTimeout:
        """A LaunchError, as the replica's own timeout is (the CLI names it in one line, not a traceback)."""
        if self.handle.restarting:  # a real model's reload outlasts the grace: the restart took its time
            return RequestTimeout(
                f"request {self.request_id} got no answer within {waited_s:.1f} s, and is now at least {_GRACE_S:g} s "
                f"past its request timeout ({self.handle.timeout_s:g} s from submission): its group failed and is "
                f"still restarting; retry it once the replica serves again, or raise request_timeout_s "
                f"(--request-timeout) to have such requests resumed", timeout_s=self.handle.timeout_s,
                lost_to_a_restart=True)
        return RequestTimeout(  # one request's own (timeout_s): the server tells it in its client's terms
            f"request {self.request_id} got no answer within {waited_s:.1f} s, and is now at least {_GRACE_S:g} s past "
            f"its request timeout ({self.handle.timeout_s:g} s from submission): its replica reported nothing, not "
            f"even that it timed out, as while it restarts a group; see replica_status() and the worker logs (ray "
            f"logs), or raise request_timeout_s (--request-timeout) for long generations", timeout_s=self.handle.timeout_s)

    def cancel(self, deferred: bool = False, reason: BaseException | None = None) -> bool:
        """Cancel the request. With a `reason`, it first ends the request's events, waking a reader
        blocked meanwhile in another thread or task (the sink takes it like any event, from any
        thread); a request that had finished is left alone (False): nothing is left to cancel."""
        if self.done:
            return False
        if reason is not None and not self.handle.fail(reason):
            return False
        self._end(reason)
        self._cancel(self.handle, deferred)
        return True

    def _end(self, reason: BaseException | None) -> None:
        """The stream ends here: no later read gets a token, what was carried included; `reason`
        for every reader but the one that closed it."""
        self.done = True
        self._carried.clear()
        self._cancelled = reason

    def _close(self, closer, by: str) -> None:
        """Cancel for `closer` (the calling thread or task), whose later reads then end quietly."""
        reason = RequestCancelled(f"request {self.request_id} was closed ({by}) by another reader of its stream, "
                                  f"after {len(self.handle.delivered)} token(s)")
        if self.cancel(reason=reason):
            self._closer = closer
        elif not self.done or self._carried:
            # The request finished on its group (nothing left to cancel) with its end not read, or
            # read tokens not handed over: the close ends the stream all the same, what is left
            # unread too (a reader that closed, then read again, got the rest of the answer).
            self._end(reason)
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
        if self.done and not self._carried:  # done, and no read tokens left to hand over
            self._ended(threading.get_ident())
            raise StopIteration
        if self.gather == 1:
            try:
                return self._next_delta()
            except Exception as err:
                return self._after_failure(err)
        while (handed := self._carried_due()) is None:
            try:
                delta = self._next_delta()
            except Exception as err:
                return self._after_failure(err)
            self._carried.extend(delta.parts or (delta,))
        return handed

    def _next_delta(self) -> StreamDelta:
        wait_s = _wait_s(self.handle)
        try:
            item = self._items.get(timeout=wait_s)
        except queue.Empty:
            overdue = self._overdue(wait_s)
            self.cancel(reason=overdue)
            self._gather_held()  # the read hands it over, then raises overdue
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
        if self.done and not self._carried:
            self._ended(asyncio.current_task())
            raise StopAsyncIteration
        if self.gather == 1:
            try:
                return await self._next_delta()
            except Exception as err:
                return self._after_failure(err)
        while (handed := self._carried_due()) is None:
            try:
                delta = await self._next_delta()
            except Exception as err:
                return self._after_failure(err)
            self._carried.extend(delta.parts or (delta,))
        return handed

    async def _next_delta(self) -> StreamDelta:
        wait_s = _wait_s(self.handle)
        try:
            item = await next_item(self._items, wait_s)
        except asyncio.TimeoutError:
            overdue = self._overdue(wait_s)
            self.cancel(reason=overdue)
            self._gather_held()  # the read hands it over, then raises overdue
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
