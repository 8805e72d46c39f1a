"""One streaming request as the driver tracks it: where its events go, what has been delivered.

The replica that serves it (launcher/cluster/replica_pool.py) appends every token it delivers, so
after a group fault the request can resume on the restarted group from exactly where its stream
stopped: the prompt plus the delivered tokens are prefilled again and generation continues for
the tokens still owed. No token is delivered twice and none is skipped; a greedy stream is the
same as without the fault.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from workers.serving.requests import StreamRequest, TokenEvent

Sink = Callable[[object], "bool | None"]
"""Receives each TokenEvent of the request, then possibly one exception (the request failed).
Returns False where no reader can take it any more (an astream whose event loop closed)."""


class StreamHandle:
    def __init__(self, request: StreamRequest, sink: Sink, timeout_s: float) -> None:
        self.request = request
        self.sink = sink
        self.submitted = time.monotonic()
        self.deadline = self.submitted + timeout_s
        self.timeout_s = timeout_s
        self.own_timeout_s = timeout_s
        """timeout_s before allow_waves: what the hung-group check judges a group by (replica_pool)."""
        self.delivered: list[int] = []
        self.first_token_at: float | None = None
        """When the first token reached the driver (not when a reader took it: generate() reads its
        streams in turn, and a later one's tokens may wait unread meanwhile)."""
        self.attempts = 0
        """Times it was handed to a TP group (its replica counts them): 1 unless a fault made a
        restarted group take it again."""
        self.resumed_at: list[int] = []
        """The index of the first token each resumed attempt produced (len(delivered) at each
        resume): the gap before it is the restart, and its time comes from another rank 0's clock."""
        self.replica: int | None = None
        self.restarting = False
        """Its replica's group failed and is being restarted (set by the replica, cleared when a group
        takes it): a reader that stops waiting meanwhile tells its client the restart took its time."""
        self.cancelled = False
        """Its cancel reached the replica that had it in flight."""
        self.closing = False
        """Its reader is done with it (ReplicaPool.cancel_stream, before the cancel reaches a replica):
        a replica no longer moves it to another, nor takes it when it arrives from one."""
        self.finished = False
        self.unread = False
        """Its sink said no reader can take its events any more (deliver): an astream kept past the
        end of its event loop (asyncio.run closes only async generators, which a stream is not)."""
        self._lock = threading.Lock()

    def allow_waves(self, waves: int) -> None:
        """A request queued behind `waves - 1` waves of rows on its replica: one timeout each, and its
        own (generate's prompts beyond the rows; its first wave keeps one)."""
        self.timeout_s *= waves
        self.deadline = self.submitted + self.timeout_s

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted

    def resumed(self) -> StreamRequest:
        """The request to submit to a restarted group: history = prompt + delivered tokens. Prompt
        log-probabilities came with the first token: once it was delivered, they were too."""
        self.resumed_at.append(len(self.delivered))
        return dataclasses.replace(self.request,
                                   prompt_token_ids=self.request.prompt_token_ids + tuple(self.delivered),
                                   max_tokens=self.request.max_tokens - len(self.delivered),
                                   draws_before=self.request.draws_before + len(self.delivered),
                                   prompt_logprobs=None if self.delivered else self.request.prompt_logprobs)

    def deliver(self, event: TokenEvent) -> bool:
        """Pass an event on (once finished, nothing more); True when it finished the request."""
        with self._lock:
            if self.finished:
                return True
            if event.token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            elif event.cached_tokens is not None:  # a resumed attempt's: its first token is not the stream's
                event = dataclasses.replace(event, cached_tokens=None)
            self.delivered.extend(event.token_ids)
            self.finished = event.finish_reason is not None
        if self.sink(event) is False:
            self.unread = True
        return self.finished

    def fail(self, error: BaseException) -> bool:
        """Pass `error` on as the request's end; False when it had finished already (nothing passed)."""
        with self._lock:
            if self.finished:
                return False
            self.finished = True
        self.sink(error)
        return True
