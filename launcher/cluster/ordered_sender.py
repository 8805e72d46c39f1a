"""Send a group's numbered calls from a thread of their own, in the order they were asked for.

Ray counts a task submitted while another runs as that task's child, and `ray.cancel(ref,
recursive=True)` cancels every child not yet started. Ray Serve's proxy cancels a request's task
that way when its client disconnects, so a submit or cancel that a request sent to rank 0 and that
was still queued behind rank 0's other calls (its serving loop holds a thread) never ran. Rank 0
runs numbered calls in order (workers/serving/numbered_calls.py): the missing number held every
later submission and cancellation of that group for good, and the replica answered nothing more
while /health still said 200. Sent from this thread, the calls belong to no request.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable

_STOP = object()


class OrderedSender:
    """A daemon thread that runs `send(item)` for each item put, one at a time, in order."""

    def __init__(self, send: Callable[[object], None], name: str) -> None:
        self._send = send
        self._name = name
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ended = False

    def put(self, item) -> None:
        with self._lock:  # started on first use: a group that never serves has no thread
            if self._ended:  # a late cancel to a killed group: a thread started for it would wait for ever
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._items,), name=self._name, daemon=True)
                self._thread.start()
            self._items.put(item)

    def close(self, final: bool = False) -> None:
        """Stop the thread once the items put before have been sent. A later put starts another,
        on a queue of its own (one queue, one reader), so the order holds among the items put after
        a close, not across it. final: every later put is dropped (a killed group, which has no
        actors to send to: a put racing its kill, a reader's cancel, started a thread that waited
        on its empty queue for ever, holding the dead group)."""
        with self._lock:
            self._ended = self._ended or final
            if self._thread is not None:
                self._items.put(_STOP)
                self._items, self._thread = queue.SimpleQueue(), None

    def _run(self, items: queue.SimpleQueue) -> None:
        while (item := items.get()) is not _STOP:
            try:
                self._send(item)
            except Exception as err:  # noqa: BLE001 - never end the thread: later calls would go unsent
                # not awaited by anyone: the group's next poll shows a rank that cannot take calls
                print(f"corelaunch: {self._name} could not send a call: {err}", file=sys.stderr)
