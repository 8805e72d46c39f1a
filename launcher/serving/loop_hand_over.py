"""Handing items from other threads to an event loop's asyncio queues, a batch at a time.

A Serve replica's thread delivers each decode step's tokens for every stream it serves one after
another; each stream's reader is a task on the replica's event loop. Scheduling one call on the loop
per token (call_soon_threadsafe) wakes the loop, through its self-pipe, once per stream per step;
here the first item of a batch schedules one call, which empties the batch, and the items put
before that call runs join it: one wake-up per step. Order is kept, per queue and across them.
"""

from __future__ import annotations

import asyncio
import threading
import weakref


class LoopHandOver:
    """Items for one event loop's queues, put from other threads (see the module's docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._batch: list[tuple[asyncio.Queue, object]] = []

    def put(self, items: asyncio.Queue, item) -> bool:
        """False where the loop has closed: nobody can read the item, nor any later one."""
        loop = self._loop
        if loop.is_closed():
            self._drop()  # nobody is left to read; a call scheduled before the close never runs
            return False
        with self._lock:
            self._batch.append((items, item))
            if len(self._batch) > 1:
                return True  # the batch's hand-over is scheduled already
        try:
            loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop closed meanwhile
            self._drop()
            return False
        return True

    def _drop(self) -> None:
        # The batch's queues hold their loop: kept, they would keep a closed loop alive.
        with self._lock:
            self._batch.clear()

    def _hand_over(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for items, item in batch:
            items.put_nowait(item)


_hand_overs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[LoopHandOver]]" = \
    weakref.WeakKeyDictionary()
"""Each loop's hand-over, weakly both ways: only the sinks (and a scheduled call) keep one, and with
it its loop, alive; this table never does."""
_hand_overs_lock = threading.Lock()


def loop_sink(items: asyncio.Queue, loop: asyncio.AbstractEventLoop):
    """Events arrive on the replica's thread; they are handed to the reader's event loop, in order,
    together with those of the loop's other streams that arrive meanwhile. The sink returns False
    once that loop has closed (StreamHandle.deliver: the request is then cancelled)."""
    with _hand_overs_lock:
        known = _hand_overs.get(loop)
        hand_over = known() if known is not None else None
        if hand_over is None:
            hand_over = LoopHandOver(loop)
            _hand_overs[loop] = weakref.ref(hand_over)

    def put(item) -> bool:
        return hand_over.put(items, item)

    return put
