"""Replicas: N independent TP groups behind one request queue, each restarted when it breaks.

Two kinds of requests reach a replica:
- streams (continuous batching, workers/serving/): each is routed when it arrives to the serving
  replica with the fewest requests in flight (running plus waiting for a cache row, and cancels
  its leader has not answered, which hold their rows until it does), handed to its
  group's leader at once, and followed by the replica's thread, which reads the tokens the leader
  streams back (launcher/cluster/event_channel.py) and passes them on. Many streams share a group at once.
  A stream that still waits for a row (none of its tokens delivered) moves to another serving
  replica as soon as that one has a free row: counts at arrival do not foresee lengths, and while
  one replica restarts the others take every new request, then held them behind their own rows
  while the restarted one sat idle. Its first replica is told to cancel it (whatever it produced
  there is dropped), so it runs, and is answered, once. A row is free only once its leader has
  answered every cancel sent to it. Streams on a replica being restarted, nothing of them
  delivered, go to a free row elsewhere at once (no leader holds them).
- static batches (the rest of this docstring): one at a time per replica, from a shared queue.

Routing: requests (one batch of prompts each) wait in one shared FIFO queue; every replica has a
thread that takes the next request whenever its group is idle. A request therefore always goes to
a replica with the least outstanding work (an idle one) and never waits behind a busy or
restarting replica. A replica that also runs streams takes one only while no other serving replica
free of a static batch holds fewer rows (_takes_static_now). A replica runs one request at a time,
so all ranks of a group see the same calls in the same order (they must: their collectives pair up
call by call).

Faults: a rank that dies, fails or hangs mid-request stops its group (tp_group.py). The replica's
thread then restarts the group, on the same or other resources (the old placement group is
released first), and re-runs the request it had in flight; requests on other replicas carry on
meanwhile. Every request's future is set exactly once, so none is lost or answered twice; a greedy
request re-run on the same layout returns exactly the tokens it would have without the fault.
Restarts are bounded by a RestartPolicy; when the bound is reached, or the cluster can no longer
host the group (placement fails, a node lost its Neuron devices), the replica is given up and the
requests it had in flight fail with a ReplicaFailed naming what is missing (its streams with nothing
delivered move to a serving replica instead, or, with none serving, to one restarting or starting).
A restart attempt that fails while the new group starts is retried after 1 s, then 2, 4, ... up to
30 s (RESTART_RETRY_FIRST_S), so a brief problem does not use up the bound at once. The other
replicas keep serving; when none is left, every queued and later request fails with NoReplicaAvailable. Idle
replicas are health-checked every few seconds so a dead rank is replaced before the next request.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from launcher.errors import (DevicesMissing, GroupFault, LaunchError, NoReplicaAvailable, PlacementTimeout, QueueFull,
                             RendezvousTimeout, ReplicaFailed, RequestFailed, RequestTimeout, RestartLimitExceeded,
                             WorkerDied)
from launcher.cluster.finish_rate import FinishRate
from launcher.cluster.restart_policy import RestartPolicy
from launcher.cluster.stream_handle import StreamHandle

_STOP = object()
POLL_WAIT_S = 0.05
"""A streaming replica's thread waits at most this long for its leader's next tokens (a poll returns
as soon as tokens arrive, so this bounds only how soon a queued static batch is noticed)."""
START_THREAD_STOP_S = 5.0
"""How long shutdown() waits, beyond the groups' grace, for start()'s threads to stop: a group polls
for a stop every half second (launcher/cluster/tp_group.py), then kills its actors."""
HUNG_AFTER_AT_LEAST_S = 30.0
"""A group whose leader makes no step while it has work is judged hung after the shortest request
timeout in flight, but never before this: one step (a long prompt's prefill chunk on a CPU) can
outlast a short timeout, and with request_timeout_s=1 four long prompts restarted a working group
four times, after which it was given up and every later request refused."""
RESTART_RETRY_FIRST_S = 1.0
"""After a failed restart attempt (a rank that died or did not join while the new group started),
the next waits this long, doubling with each further failed attempt up to RESTART_RETRY_LONGEST_S:
retried at once, a brief problem (a node's agent restarting) used up max_restarts in milliseconds
and the replica was given up. The first restart after a fault stays immediate."""
RESTART_RETRY_LONGEST_S = 30.0


@dataclass
class StartedGroup:
    """A TP group that has been placed, joined and loaded (what a GroupFactory returns)."""

    group: object
    """launcher.cluster.tp_group.TPGroup (or anything with generate/kill/shutdown/dead_ranks/workers)."""
    load_stats: list = field(default_factory=list)
    serving_compile: dict | None = None
    """Rank 0's compile stats once its serving loop was prepared (after a --warm-up's graphs): the
    graphs built after it were built during the requests."""


GroupFactory = Callable[[int, bool], StartedGroup]
"""(replica index, is_restart) -> a started, loaded group; raises when it cannot be started."""

STOPPED_BY_SHUTDOWN = "stopped_by_shutdown"
"""An attribute, True on what a GroupFactory raises when the launcher's shutdown stopped the group
it made (launcher/cluster/tp_group.py stopped_by_shutdown): a restart cut short so is given up on
quietly. The shutdown tells the launcher's group before this pool (ReplicaPool.stopping)."""


@dataclass
class ReplicaOutput:
    replica: int
    """Index of the replica that answered."""
    attempts: int
    """1, or more when the request was re-run after its group failed."""
    outputs: object
    """Rank 0's outputs (a list of workers.engine.GenerationOutput)."""


@dataclass
class _Item:
    request: object
    future: Future = field(default_factory=Future)
    attempts: int = 0


class Replica:
    """One TP group and the thread that feeds it requests, restarting it within its policy."""

    def __init__(self, index: int, pool: "ReplicaPool", policy: RestartPolicy):
        self.index = index
        self.pool = pool
        self.policy = policy
        self.state = "starting"
        """starting | serving | restarting | failed | stopped"""
        self.started: StartedGroup | None = None
        self.restarts = 0
        self.served = 0
        self.busy = False
        self.failure: ReplicaFailed | None = None
        self.last_recovery_s: float | None = None
        """Seconds from noticing the last fault to the restarted group being ready."""
        self._thread: threading.Thread | None = None
        self.streams: dict[str, StreamHandle] = {}
        """Streaming requests in flight here, by request id."""
        self.cancelling: set[str] = set()
        """Ids of timed-out requests whose cancel the leader has not answered yet: their late events
        are dropped, and the id is not free for a new request until the answer comes."""
        self._streams_lock = threading.Lock()
        self.dropped: queue.SimpleQueue[StreamHandle] = queue.SimpleQueue()
        """Streams their reader dropped unread (garbage-collected): cancelled at the next poll, by
        handle, since by then the request may have finished and a new one taken its id."""
        self.loop_counters: dict = {}
        """The leader's serving-loop counters at the last poll (steps, step_s, plan_s)."""
        self._watched_progress: tuple[int, int] | None = None
        self._quiet_since = 0.0
        """When the leader's progress last changed while this group had work (see _check_hung)."""
        self._quiet_limit: float | None = None
        """The shortest request timeout in flight since then."""
        self._stall_limit_s: float | None = None
        """The request timeout of the last stream handed over: how long the group may go without a
        step while it has only cancels left to answer (with streams, their shortest timeout)."""
        self._handed: set[str] = set()
        """Ids handed to the current group and not yet finished there: only these may wait in
        `cancelling`, since a leader answers a cancel only for an id it has. A cancel for an id it
        never had (a stream booked while the group started) kept the id taken, and its row counted,
        forever."""

    # ---- the serving loop --------------------------------------------------------------------
    def run(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"corelaunch-replica-{self.index}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            self._serve_queue()
        except Exception as err:  # noqa: BLE001 - never a silent end of this thread: its requests would hang
            self._give_up(ReplicaFailed(f"replica {self.index} stopped on an unexpected error "
                                        f"({_first_line(err)}); its requests failed"), err)

    def _serve_queue(self) -> None:
        pool = self.pool
        while not pool.stopping and self.state != "failed":
            streaming = getattr(self.started.group, "serving", False)
            if streaming and (pool._queue.empty() or not self._takes_static_now()):  # no batch: nothing to weigh
                self._poll_streams()  # waits up to POLL_WAIT_S, as when the queue is empty
                continue
            try:
                item = pool._queue.get_nowait() if streaming else pool._queue.get(timeout=pool.health_check_interval_s)
            except queue.Empty:
                if streaming:
                    self._poll_streams()
                else:
                    self._health_check()
                continue
            if item is _STOP:
                break
            self._serve(item)
            if streaming and self.state == "serving":
                # Between queued static batches too: their backlog held every stream's tokens (and
                # deadlines, and dropped streams' cancels) until the last had run.
                self._poll_streams(wait_s=0.0)
        if self.state != "failed":
            self.state = "stopped"

    def _takes_static_now(self) -> bool:
        """Whether this streaming replica may take the next static batch: only while no other serving
        replica free of a static batch holds fewer rows. Taken whatever the streams' load, every batch
        went to a replica full of streams (stalling them) while another one idled. The least loaded
        of those free always takes it (ties take it too), so no batch waits forever; one busy with
        a static batch or restarting does not count, so none waits behind it either."""
        free = [r.rows_taken() for r in self.pool.replicas if r.state == "serving" and not r.busy]
        return not free or self.rows_taken() <= min(free)

    # ---- streams -----------------------------------------------------------------------------
    def submit_stream(self, handle: StreamHandle, moved: bool = False, resumed: bool = False) -> None:
        """moved: taken from another replica where it waited for a row (not a new attempt);
        resumed: from one whose group failed (an attempt, as a resume on the restarted group is)."""
        with self._streams_lock:
            if moved and handle.closing:  # its reader cancelled it while it moved: it is over
                return
            self.streams[handle.request_id] = handle
            handle.replica = self.index
            if self.state == "serving":
                # a stream its failed group never had (submitted during the restart) is no resume
                request = handle.resumed() if resumed and handle.attempts else handle.request
                self._hand_over(handle, request, counted=resumed or not moved)
            # else the start in progress hands it over (_begin_serving), or the restart in
            # progress with the others (_resume_streams)

    def cancel_stream(self, request_id: str, only: StreamHandle | None = None) -> None:
        """only: cancel the request only while it is still that handle's (not a later one's with its id)."""
        with self._streams_lock:
            handle = self.streams.get(request_id)
            if handle is None or (only is not None and handle is not only):
                return
            handle.cancelled = True
            # Out of the books at once, as a timed-out request: its reader is done with it (a stop
            # string, a close, a client gone), so load() and admission stop counting it now.
            self._out_of_the_books(request_id)
            self.served += 1
            if self.state == "serving" and request_id in self._handed:
                # Its id stays taken until the leader's answer; its late events are dropped.
                self.cancelling.add(request_id)
                self.started.group.cancel([request_id])  # the leader answers with an "abort" event
            # else the group is restarting (or gone): no leader will answer, and the restart does
            # not resubmit what is no longer in the books, so the id is free at once

    def _surely_queued(self) -> set[str]:
        """The streams in the books that wait for a row: those with at least `rows` requests without
        structured output before them. The leader seats requests in the books' order, but one with
        structured output may wait for its grammar outside the queue while later ones take the rows."""
        queued, plain_ahead = set(), 0
        for request_id, handle in self.streams.items():
            if plain_ahead >= (self.pool.rows or 0):
                queued.add(request_id)
            plain_ahead += handle.request.sampling.structured_output is None
        return queued

    def _out_of_the_books(self, request_id: str) -> None:
        """A stream that ended here (finished, cancelled, timed out) leaves the replica's books, and
        the pool's pace of ends (a full queue's Retry-After) counts it; a stream moved elsewhere does
        not end, and is popped alone."""
        self.streams.pop(request_id)
        self.pool.finish_rate.record()

    def _poll_streams(self, wait_s: float = POLL_WAIT_S) -> None:
        while not self.dropped.empty():
            dropped = self.dropped.get_nowait()  # only this thread takes from it
            if dropped.replica != self.index:  # moved to another replica before its reader dropped it
                self.pool.replicas[dropped.replica].dropped.put(dropped)
                continue
            self.cancel_stream(dropped.request_id, only=dropped)
        group = self.started.group
        try:
            events, load, counters = group.poll(wait_s)
        except GroupFault as fault:
            if self.pool.stopping:
                return
            self._restart(fault)  # resumes the streams on the new group, or fails them
            return
        self.loop_counters = counters
        for event in events:
            with self._streams_lock:
                if event.finish_reason is not None:  # the leader has no more of it
                    self._handed.discard(event.request_id)
                if event.request_id in self.cancelling:  # a timed-out request's last events
                    if event.finish_reason is not None:
                        self.cancelling.discard(event.request_id)
                    continue
                handle = self.streams.get(event.request_id)
                if handle is not None and event.finish_reason is not None:
                    # Out of the books before the reader learns it finished (load() is then exact).
                    self._out_of_the_books(event.request_id)
                    self.served += 1
            if handle is not None and event.finish_reason == "error":
                handle.fail(RequestFailed(f"request {handle.request_id} failed: {event.error}"))
            elif handle is not None and not handle.deliver(event) and handle.unread and not handle.closing:
                # its reader's event loop has closed: nothing will read or close it, so it would run
                # on to max_tokens holding its row (cancelled at the next poll, as a dropped one)
                self.pool.cancel_stream(handle, deferred=True)
        now = time.monotonic()
        with self._streams_lock:
            late = [h for h in self.streams.values() if now > h.deadline]
            queued = self._surely_queued() if late else set()
            for handle in late:
                self._out_of_the_books(handle.request_id)  # a queued request may take its place
                if handle.request_id in self._handed:
                    self.cancelling.add(handle.request_id)
        for handle in late:
            group.cancel([handle.request_id])
            handle.fail(_overdue(handle, "it was cancelled",
                                 waited_for_a_slot=handle.request_id in queued and not handle.delivered))
        self._lend_waiting()
        self._take_from_restarting()
        self._check_hung(now)

    def _lend_waiting(self) -> None:
        """Move streams that wait for a row here to serving replicas with a free one (module
        docstring). On this replica's thread, the only one that delivers its streams' events, so a
        stream seen here with nothing delivered has nothing on its way to its reader either."""
        pool = self.pool
        rows = pool.rows
        if rows is None or len(self.streams) <= rows:  # nothing waits here: no lock taken
            return
        if not any(r is not self and r.state == "serving" and r.free_rows() > 0 for r in pool.replicas):
            return  # no free row elsewhere (the usual case under load): no lock taken either
        with pool._lock:  # no request routed meanwhile: the counts below stay true
            if pool.stopping:
                return
            for taker in sorted((r for r in pool.replicas if r is not self and r.state == "serving"),
                                key=lambda r: -r.free_rows()):
                free, waiting = taker.free_rows(), len(self.streams) - rows
                if free <= 0 or waiting <= 0:
                    return
                for handle in self._give_away(min(free, waiting), taker.index, taker.owed_cancels()):
                    taker.submit_stream(handle, moved=True)

    def owed_cancels(self) -> set[str]:
        """The ids whose cancel this replica's leader has not answered yet: a stream with one of them
        is not moved here until it has. Moved back to the leader that still owed its old cancel, its
        old abort took the id out of `_handed`, and a later cancel of the new one was never sent (the
        leader ran it to max_tokens while the books counted its row free)."""
        with self._streams_lock:
            return set(self.cancelling)

    def free_rows(self) -> int:
        """Rows this replica's leader has free, as far as the driver knows (negative: requests wait)."""
        return (self.pool.rows or 0) - self.rows_taken()

    def rows_taken(self) -> int:
        """The streams in flight here and the cancels its leader has not answered: their requests hold
        their rows (or places in its queue) until it does. Routing goes by this, not by the books alone:
        a hung leader whose readers all gave up holds every row with none in its books, and looked the
        emptiest replica, taking each new request. (The queue limit and moves between replicas go by
        the books: see submit_streams and _give_away.)"""
        return len(self.streams) + len(self.cancelling)

    def _take_from_restarting(self) -> None:
        """Take streams that wait on a replica whose group is being restarted into this one's free
        rows (oldest first): nothing of them was delivered, and no leader holds them (the old group
        is gone, the new one not there yet), so they run here at once instead of after the restart.
        A replica's restart (placement, loading) takes seconds to minutes."""
        pool = self.pool
        if pool.rows is None or self.free_rows() <= 0:
            return
        if not any(r.state == "restarting" and r.streams for r in pool.replicas):  # no lock taken
            return
        with pool._lock:
            if pool.stopping or self.state != "serving":
                return
            owed = self.owed_cancels()
            for donor in pool.replicas:
                if donor is self or self.free_rows() <= 0:
                    continue
                for handle in donor._hand_from_restart(self.free_rows(), self.index, owed):
                    self.submit_stream(handle, moved=True, resumed=True)

    def _hand_from_restart(self, count: int, taker: int, owed: set[str]) -> list[StreamHandle]:
        """Up to `count` of this restarting replica's streams with nothing delivered, oldest first,
        out of its books (so its restart does not resume them); none whose id is in `owed` (the
        taker's leader still owes its old cancel: owed_cancels)."""
        with self._streams_lock:
            if self.state != "restarting":
                return []
            moving = [h for h in self.streams.values()
                      if not h.delivered and not h.closing and h.request_id not in owed][:count]
            for handle in moving:
                self.streams.pop(handle.request_id)
                handle.replica = taker
        return moving

    def _give_away(self, count: int, taker: int, owed: set[str]) -> list[StreamHandle]:
        """Up to `count` streams that wait for a row here, newest first, out of the books and
        cancelled here; their ids stay in `cancelling` until the leader answers, so its late events
        for them are dropped. The leader seats requests in the order they came (the books' order),
        so only those after the first `rows` wait; one of those with tokens delivered stays (it got
        a row since: moving it would be a resume)."""
        with self._streams_lock:
            if self.state != "serving":
                return []
            waiting = list(self.streams.values())[self.pool.rows:]
            moving = [h for h in reversed(waiting)
                      if not h.delivered and not h.closing and h.request_id not in owed][:count]
            for handle in moving:
                self.streams.pop(handle.request_id)
                if handle.request_id in self._handed:
                    self.cancelling.add(handle.request_id)
                handle.replica = taker  # a cancel from its reader now goes there (ReplicaPool.cancel_stream)
            if moving:
                self.started.group.cancel([h.request_id for h in moving])
        return moving

    def _check_hung(self, now: float) -> None:
        """Replace the group when its leader made no step and ran no static batch for a whole request
        timeout (and at least HUNG_AFTER_AT_LEAST_S) while it had work: streams in flight, or
        cancels it has not answered. The group is hung (a rank stuck in a forward or a device wait,
        its keepalives still flowing); left alone, it looked the least loaded and got every request.
        Judged on the group, not on any one request: clients that give up before their own deadline
        (an HTTP client's timeout) left no late request to judge it by, and a hang that began after
        a request's last step cost the next request its whole timeout too. (A stream resumed after a
        fault with little of its time left is not judged on that remainder.)"""
        progress = self._leader_progress()
        with self._streams_lock:
            busy = bool(self.streams or self.cancelling)
            # the shortest timeout in flight, each request's own: generate() gives a prompt a timeout
            # per wave of rows ahead of it, behind other callers' requests too, which a group making
            # no step at all must not be given
            limits = [h.own_timeout_s for h in self.streams.values()]
        if not busy or progress != self._watched_progress:
            self._watched_progress, self._quiet_since, self._quiet_limit = progress, now, None
            return
        # the shortest seen since the quiet began: a timed-out stream leaves the books, and the
        # next wave's longer timeout must not restart the count
        current = min(limits) if limits else self._stall_limit_s
        if current is not None:
            self._quiet_limit = current if self._quiet_limit is None else min(self._quiet_limit, current)
        if self._quiet_limit is None:
            return
        # a step may take longer than a short request timeout (a long prompt's prefill on a slow
        # host): the request times out, the group is not judged hung before HUNG_AFTER_AT_LEAST_S
        limit = max(self._quiet_limit, HUNG_AFTER_AT_LEAST_S)
        if now - self._quiet_since >= limit and not self.pool.stopping:
            why = "the request timeout" if limit == self._quiet_limit else "the least a step is given"
            self._restart(RequestTimeout(
                f"replica {self.index}'s group made no step in {limit:g} s ({why}) with requests in flight; it "
                f"looks hung and is replaced (if its steps are only slow, a long prompt's prefill on a slow host, "
                f"raise --request-timeout or lower --max-prefill-tokens)"))

    def _hand_over(self, handle: StreamHandle, request, counted: bool = True) -> None:
        """Submit a stream's request to the group (its timeout is what the hung-group check allows).
        counted: an attempt (a stream moved here from a replica where it only waited is not one)."""
        handle.attempts += counted
        handle.restarting = False
        self._stall_limit_s = handle.own_timeout_s
        self._handed.add(handle.request_id)
        self.started.group.submit([request])

    def _begin_serving(self, started: StartedGroup) -> None:
        """Install the group start() made and hand it every stream booked while it started (one
        routed here from another thread while Launcher.start() still loaded): nothing else would,
        and the stream timed out unseen. Under the streams lock, so a stream booked meanwhile is
        either seen here or sees "serving" and is handed over by submit_stream."""
        with self._streams_lock:
            self.started, self.state = started, "serving"
            self._handed = set()
            if getattr(started.group, "serving", False):
                for handle in list(self.streams.values()):
                    if handle.closing:  # its reader dropped it during the start: nothing to run
                        self._forget_closed(handle)
                    else:
                        self._hand_over(handle, handle.request)

    def _leader_progress(self) -> tuple[int, int]:
        """The leader's (steps, static batches) at the last poll."""
        return self.loop_counters.get("steps", 0), self.loop_counters.get("static_batches", 0)

    def _resume_streams(self) -> None:
        """On a freshly (re)started group: every stream in flight continues where it stopped.
        Called with _streams_lock held: a cancelled stream has already left the books (cancel_stream
        takes it out under the same lock), so only live streams are resubmitted."""
        now = time.monotonic()
        for handle in list(self.streams.values()):
            if handle.closing:  # its reader dropped it during the restart: a prefill for nobody
                self._forget_closed(handle)
                continue
            if now > handle.deadline:  # its prompt would be prefilled again only to time out
                self._out_of_the_books(handle.request_id)
                handle.fail(_overdue(handle, "its group failed and it was not resumed", lost_to_a_restart=True))
                continue
            self._hand_over(handle, handle.resumed())

    def _forget_closed(self, handle: StreamHandle) -> None:
        """A stream its reader closed that no group holds: out of the books as cancel_stream takes
        it (its cancel, still queued in `dropped` or on its way, then finds nothing to do)."""
        handle.cancelled = True
        self._out_of_the_books(handle.request_id)
        self.served += 1

    def _take_streams(self) -> list[StreamHandle]:
        with self._streams_lock:
            handles, self.streams = list(self.streams.values()), {}
        return handles

    def _serve(self, item: _Item) -> None:
        if not item.future.set_running_or_notify_cancel():
            return  # the caller gave up on it (Ctrl-C) before it started
        while True:
            item.attempts += 1
            group = self.started.group
            self.busy = True
            try:
                outputs = group.generate(item.request)
            except GroupFault as fault:
                if self.pool.stopping:
                    _fail(item, LaunchError("the launcher was shut down while this request was running"))
                    return
                if isinstance(fault, RequestTimeout):
                    _fail(item, fault)  # reported first (it would time out again); then the group is replaced
                    self._restart(fault, counted=False)
                    return
                if not self._restart(fault):
                    # given up (self.failure), or the launcher is shutting down (no failure to name)
                    _fail(item, self.failure or LaunchError("the launcher was shut down while this request "
                                                            "was running"))
                    return
                continue  # re-run on the restarted group
            except BaseException as err:  # noqa: BLE001 - the caller's error (a bad request) goes to its future
                _fail(item, err)
                if not group.actors and not self.pool.stopping:  # the error took the group down
                    self._restart(err)
                return
            finally:
                self.busy = False
            self.served += 1
            _succeed(item, ReplicaOutput(replica=self.index, attempts=item.attempts, outputs=outputs))
            return

    def _health_check(self) -> None:
        if self.state != "serving" or self.pool.stopping:
            return
        try:
            dead = self.started.group.dead_ranks(timeout_s=min(5.0, self.pool.health_check_interval_s * 2))
        except Exception as err:  # noqa: BLE001 - a check that cannot answer counts as a failed group
            dead = [f"the health check ({_first_line(err)}); the group"]
        if dead and not self.pool.stopping:
            self._restart(WorkerDied(f"{', '.join(dead)} died while replica {self.index} was idle"))

    # ---- restarts ----------------------------------------------------------------------------
    def _restart(self, cause: BaseException, counted: bool = True) -> bool:
        """Replace the broken group; False (and the replica failed) when that is not possible.
        counted False: a static batch that outlasted its timeout, whose group is replaced to stop it
        (nothing else can), not counted against the restart policy: a group merely slow on long
        batches was given up as a crash loop after max_restarts of them, failing every later request.
        A failure while making the new group counts as any other, and max_restarts 0 still means no
        restart at all."""
        noticed = time.monotonic()
        failed_attempts = 0
        idle = self.pool._idle()  # a fault found on an idle pool (the health check): its idle time is no stall
        with self._streams_lock:  # a cancel_stream that saw "serving" has handed its cancel to the old group
            self.state = "restarting"
            for handle in self.streams.values():
                handle.restarting = True  # a reader giving up meanwhile says so (request_streams)
        if idle:
            self.pool.finish_rate.became_busy()
        if self.started is not None:
            self.started.group.kill()
        while True:
            if self.pool.stopping:  # shut down meanwhile: no new group (nor a new Ray) behind its back
                return False
            if (counted or self.policy.max_restarts == 0) and not self.policy.allow():  # 0: never restarted
                if self.policy.max_restarts == 0:
                    why = "restarts are disabled (max_restarts=0; raise --max-restarts to restart failed groups)"
                else:
                    why = (f"it was already restarted {self.policy.recent()} times within "
                           f"{self.policy.window_s:g} s ({self.policy.describe()}), so it looks like a crash "
                           f"loop; find the cause in the message below and the worker logs (ray logs), or raise "
                           f"--max-restarts / lower --restart-window")
                self._give_up(RestartLimitExceeded(f"replica {self.index} failed and is given up: {why}. "
                                                   f"Last failure: {cause}"), cause)
                return False
            if failed_attempts:  # the last attempt failed: give a brief problem time to pass
                delay = min(RESTART_RETRY_FIRST_S * 2 ** (failed_attempts - 1), RESTART_RETRY_LONGEST_S)
                if self.pool._stopped.wait(delay):  # shut down meanwhile: wake at once, no new group
                    return False
            self.restarts += 1
            budget = (f"restart {self.policy.recent()} of at most {self.policy.max_restarts} within "
                      f"{self.policy.window_s:g} s" if counted else "a timed-out batch's, not counted against max_restarts")
            self.pool._note(f"replica {self.index}: {_first_line(cause)}; restarting its group ({budget})")
            counted = True  # a failure from here on (the new group's start) is a restart like any other
            try:
                started = self.pool._make_group(self.index, True)
            except (PlacementTimeout, DevicesMissing) as err:
                self._give_up(ReplicaFailed(f"replica {self.index} lost its group ({_first_line(cause)}) and "
                                            f"the cluster cannot host it any more: {err}"), err)
                return False
            except (GroupFault, RendezvousTimeout) as err:  # a rank died or hung starting: another failure
                cause = err
                failed_attempts += 1
                continue
            except BaseException as err:  # noqa: BLE001 - anything else cannot be cured by retrying
                if self.pool.stopping or getattr(err, STOPPED_BY_SHUTDOWN, False):
                    # The launcher's shutdown stopped the new group (before it told the pool): no
                    # failure of this replica, and no "fix the cluster" for its requests, which
                    # fail with the shutdown's own error.
                    return False
                self._give_up(ReplicaFailed(f"replica {self.index} lost its group ({_first_line(cause)}) and "
                                            f"could not be restarted: {type(err).__name__}: {err}"), err)
                return False
            if self.pool.stopping:
                started.group.kill()
                return False
            with self._streams_lock:
                if self.pool.stopping:  # a shutdown since the check above killed the old group, not this one
                    started.group.kill()
                    return False
                self.started = started
                self.state = "serving"
                self.loop_counters = {}  # the old leader's: the new one's come with its first poll
                self._watched_progress = None  # the new group is judged from its start
                self.cancelling.clear()  # the old group, and whatever it still owed, is gone
                self._handed = set()
                if getattr(started.group, "serving", False):
                    self._resume_streams()
            self.last_recovery_s = time.monotonic() - noticed
            self.pool._note(f"replica {self.index}: serving again after {self.last_recovery_s:.1f} s")
            return True

    def _give_up(self, error: ReplicaFailed, cause: BaseException) -> None:
        error.__cause__ = cause
        self.failure = error
        with self._streams_lock:
            self.state = "failed"
            self.cancelling.clear()  # no group will answer these cancels: the ids are free again
        if self.started is not None:
            self.started.group.kill()
        self._move_unstarted_streams()
        self.pool._replica_failed(self)
        for handle in self._take_streams():  # as its static requests: they fail, naming what is missing
            handle.fail(error)

    def _move_unstarted_streams(self) -> None:
        """As a restart does (_take_from_restarting), a replica given up hands its streams with
        nothing delivered to serving replicas (each to the least loaded), which run them from their
        prompt: failing them failed requests another replica could answer. With none serving, to
        those restarting or starting, as routing does (ReplicaPool.submit_streams): their new group
        takes them (failed, they were refused while a new request went there)."""
        pool = self.pool
        with pool._lock:  # no request routed meanwhile: the loads compared below stay true
            others = [r for r in pool.replicas if r is not self]
            takers = ([r for r in others if r.state == "serving"]
                      or [r for r in others if r.state in ("restarting", "starting")])
            if pool.stopping or not takers:
                return
            placed = {r.index: 0 for r in takers}
            # a restarting or starting taker's leader is gone or not there yet: it owes no cancel (the
            # restart clears them before its new group is handed its streams)
            owed = {r.index: r.owed_cancels() if r.state == "serving" else set() for r in takers}
            moves = []
            with self._streams_lock:  # as _hand_from_restart: a cancel from its reader now goes where it went
                for handle in [h for h in self.streams.values() if not h.delivered and not h.closing]:
                    eligible = [r for r in takers if handle.request_id not in owed[r.index]]
                    if not eligible:  # every taker's leader still owes its old cancel: it fails here
                        continue
                    taker = min(eligible, key=lambda r: r.rows_taken() + placed[r.index])
                    placed[taker.index] += 1
                    self.streams.pop(handle.request_id)
                    handle.replica = taker.index
                    moves.append((taker, handle))
            for taker, handle in moves:
                taker.submit_stream(handle, moved=True, resumed=True)

    def status(self) -> dict:
        group = self.started.group if self.started is not None else None
        workers = list(getattr(group, "workers", []) or []) if self.state in ("serving", "starting") else []
        # busy: a static batch running, or streams in flight (running or waiting for a row)
        return {"index": self.index, "state": self.state, "busy": self.busy or bool(self.streams),
                "restarts": self.restarts,
                "streams": len(self.streams),
                "served": self.served, "last_recovery_s": self.last_recovery_s,
                "failure": str(self.failure) if self.failure else None,
                "workers": workers, "nodes": sorted({w["node_id"] for w in workers if "node_id" in w}),
                "node_groups": group.node_groups() if workers and hasattr(group, "node_groups") else [],
                "load_source": sorted({getattr(s, "source", "?") for s in self.started.load_stats})
                if self.started is not None else []}


def _overdue(handle: StreamHandle, what_then: str, waited_for_a_slot: bool = False,
             lost_to_a_restart: bool = False) -> RequestTimeout:
    # "delivered": a group holds up to 64 of a whole answer's tokens before sending them (its
    # stream_interval), which a timeout drops: "it had 1 of 1000" was said of a request 45 tokens in
    if lost_to_a_restart:  # the restart, not the request's length, took its time: a retry is served
        return RequestTimeout(
            f"request {handle.request_id} did not finish within {handle.timeout_s:g} s (it had delivered "
            f"{len(handle.delivered)} of {handle.request.max_tokens} tokens): {what_then}, its group's restart having "
            f"outlasted that time; retry it, or raise request_timeout_s (--request-timeout) to have such requests "
            f"resumed", timeout_s=handle.timeout_s, lost_to_a_restart=True)
    if waited_for_a_slot:  # it was told to ask for fewer tokens, of which it had generated none
        return RequestTimeout(
            f"request {handle.request_id} did not finish within {handle.timeout_s:g} s: it waited all that time "
            f"for a sequence slot, every one busy with other requests; {what_then}. Retry it later, or raise "
            f"max_num_seqs (--max-num-seqs) or request_timeout_s (--request-timeout)",
            timeout_s=handle.timeout_s, waited_for_a_slot=True)
    return RequestTimeout(
        f"request {handle.request_id} did not finish within {handle.timeout_s:g} s (it had delivered "
        f"{len(handle.delivered)} of {handle.request.max_tokens} tokens); {what_then}. Raise "
        f"request_timeout_s (--request-timeout) for long generations", timeout_s=handle.timeout_s)


SHUTTING_DOWN = ("the launcher is shut down (or shutting down); call start() again (or enter it as a context "
                 "manager) once shutdown() has returned")
"""A request that raced shutdown(): the same Launcher starts again (a new one is not needed)."""


class ReplicaPool:
    """`count` replicas built by `make_group`, fed from one queue (see the module docstring)."""

    def __init__(self, count: int, make_group: GroupFactory, policy: Callable[[], RestartPolicy],
                 health_check_interval_s: float = 2.0, note: Callable[[str], None] | None = None):
        if count < 1:
            raise ValueError(f"replicas ({count}) must be at least 1")
        self._make_group = make_group
        self.health_check_interval_s = health_check_interval_s
        self._given_note = note or (lambda text: None)
        self.replicas = [Replica(i, self, policy()) for i in range(count)]
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        """Set by shutdown(): `stopping`, and it wakes a restart waiting before its next attempt."""
        self._next_first = 0
        """Where the next routing starts among its candidates: ties in load go round robin."""
        self._start_threads: list[threading.Thread] = []
        """start()'s threads, one a replica: shutdown() waits for them before Ray can be closed."""
        self._no_replica: NoReplicaAvailable | None = None
        self.rows: int | None = None
        """Cache rows per replica (max_num_seqs), from the streams submitted: what a replica's
        streams beyond it wait for, and what a stream waiting elsewhere may move into."""
        self.finish_rate = FinishRate()
        """Streams leaving their rows, for a full queue's Retry-After."""
        self.start_failed = threading.Event()
        """Set as start() sees a replica's start fail: the others' starts stop at their next check
        (make_group's stop_asked), rather than load and warm up groups that are about to be killed."""

    def _note(self, text: str) -> None:
        """A note to the driver's user (restarts, recoveries). A note that fails to print (a closed
        stderr, a printer's error) is dropped: it must never end the replica it was about."""
        try:
            self._given_note(text)
        except Exception:  # noqa: BLE001 - only a message is lost
            pass

    def start(self) -> None:
        """Start every replica's group at once; on any failure stop them all and raise the first."""
        errors: dict[int, BaseException] = {}
        failed_first: list[int] = []
        """The replicas whose start failed by itself, in the order they failed (the others stopped for them)."""

        def start_one(replica: Replica) -> None:
            try:
                started = self._make_group(replica.index, False)
            except BaseException as err:  # noqa: BLE001 - re-raised below on the caller's thread
                errors[replica.index] = err
                with self._lock:
                    if not self.start_failed.is_set():
                        failed_first.append(replica.index)
                    self.start_failed.set()
                return
            with self._lock:  # shutdown() sets stopping under this lock, then looks for started groups
                if not self.stopping:
                    replica._begin_serving(started)
                    return
            started.group.kill()  # shut down while it started (Ctrl-C): the shutdown could not see it
            errors[replica.index] = LaunchError("the launcher was shut down while this replica started")

        threads = [threading.Thread(target=start_one, args=(r,), daemon=True) for r in self.replicas]
        self._start_threads = threads
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.shutdown()
            index = failed_first[0] if failed_first else min(errors)
            first = errors[index]
            if len(self.replicas) > 1:
                first.add_note(f"(replica {index} of {len(self.replicas)}, the first whose start failed; "
                               f"{len(errors)} replica(s) failed to start)")
            raise first
        for replica in self.replicas:
            replica.run()

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request) -> Future:
        """Queue one request; its future resolves to a ReplicaOutput or raises the request's error."""
        item = _Item(request)
        with self._lock:
            if self.stopping:
                raise LaunchError(SHUTTING_DOWN)
            if self._no_replica is not None:
                raise NoReplicaAvailable(str(self._no_replica))
            self._queue.put(item)
        return item.future

    def submit_stream(self, handle: StreamHandle, queue_limit: int | None = None, rows: int = 1) -> None:
        """Route a streaming request to the replica with the fewest in flight (see the module docstring)."""
        self.submit_streams([handle], queue_limit, rows)

    def submit_streams(self, handles: list[StreamHandle], queue_limit: int | None = None, rows: int = 1,
                       timeout_per_wave: bool = False) -> None:
        """Route each request to the replica with the fewest in flight, all admitted together or none.

        queue_limit: QueueFull (nothing submitted) when the first request would wait for one of the
        `rows` cache rows of its replica while queue_limit requests already wait. Decided under the
        pool's lock, so callers on several threads cannot all slip under the limit.
        timeout_per_wave: a request with k waves of rows ahead of it on the replica it goes to (every
        request in flight there, its own call's and others') gets k + 1 timeouts (generate's prompts).
        Counted where it lands: spread evenly over the replicas in the count, a call whose replica
        was restarting (or held another caller's requests) timed out prompts queued four waves deep."""
        with self._lock:
            if self.stopping:
                raise LaunchError(SHUTTING_DOWN)
            if self._no_replica is not None:
                raise NoReplicaAvailable(str(self._no_replica))
            self.rows = rows
            # Events find their stream by request id: a second one in flight would take the first's.
            ids = [h.request_id for h in handles]
            seen: set[str] = set()  # a set, not ids.count(): 16,000 prompts took 3 s under this lock
            for request_id in ids:
                if any(request_id in r.cancelling for r in self.replicas):  # closed, timed out or stopped
                    raise ValueError(f"request_id {request_id!r} belongs to a request that has ended here (closed, "
                                     f"timed out, or finished on a stop string, which the group is told to cancel) "
                                     f"or that moved to another replica while it waited for a row, but whose cancel "
                                     f"its first group has not answered yet; retry the id in a moment, or give each "
                                     f"request its own id (or none: one is generated)")
                if request_id in seen or any(request_id in r.streams for r in self.replicas):
                    raise ValueError(f"request_id {request_id!r} is already in flight; give each request its "
                                     f"own id (or none: one is generated)")
                seen.add(request_id)
            candidates = ([r for r in self.replicas if r.state == "serving"]
                          or [r for r in self.replicas if r.state in ("restarting", "starting")])
            if not candidates:  # the last replica was just given up; _replica_failed is on its way
                reasons = "; ".join(f"replica {r.index}: {r.failure}" for r in self.replicas if r.failure)
                raise NoReplicaAvailable(f"no replica is left to serve requests ({reasons or 'none serving'})")
            # The limit goes by the books: a request that ended on a stop string is cancelled on its
            # group, and the next one must not be refused in the step before the leader answers.
            least = min(len(r.streams) for r in candidates)
            waiting = self.load(rows)["waiting"]
            if queue_limit is not None and least >= rows and waiting >= queue_limit:
                queue = (f"{waiting} requests already wait for one (max_queued_requests {queue_limit})" if queue_limit
                         else "none may wait for one (max_queued_requests 0)")
                raise QueueFull(f"every sequence slot is busy (max_num_seqs {rows} per replica) and {queue}; retry "
                                f"later, or raise max_queued_requests or max_num_seqs (--max-queued-requests, "
                                f"--max-num-seqs)", retry_after_s=self.finish_rate.retry_after_s(), slots=rows,
                                queue_limit=queue_limit)
            if self._idle():
                self.finish_rate.became_busy()  # the time it stood idle is no stall of its ends
            for handle in handles:
                # min() takes the first of equals: rotated, so ties do not all go to replica 0
                first, self._next_first = self._next_first % len(candidates), self._next_first + 1
                replica = min(candidates[first:] + candidates[:first], key=Replica.rows_taken)
                if timeout_per_wave:
                    handle.allow_waves(replica.rows_taken() // rows + 1)
                replica.submit_stream(handle)

    def cancel_stream(self, handle: StreamHandle, deferred: bool = False) -> None:
        """deferred: from a finalizer, which takes no lock (the thread it runs in may hold one);
        the replica's thread cancels the request at its next poll."""
        if handle.replica is None:
            return
        # First, so that a stream moving to another replica meanwhile is not handed over there
        # (Replica.submit_stream), and a move does not pick it (Replica._give_away).
        handle.closing = True
        index = handle.replica
        if deferred:
            self.replicas[index].dropped.put(handle)  # SimpleQueue.put is safe to call from __del__
            return
        while True:
            self.replicas[index].cancel_stream(handle.request_id, only=handle)  # not a later request's with its id
            if handle.replica == index:
                return
            index = handle.replica  # it moved meanwhile: cancel it where it went

    def load(self, rows: int) -> dict[str, int]:
        """Streams (sequences: one per prompt and choice) running, each holding one of a replica's
        `rows` cache rows, and waiting for one."""
        flights = self.in_flight()
        return {"running": sum(min(n, rows) for n in flights), "waiting": sum(max(n - rows, 0) for n in flights)}

    def _idle(self) -> bool:
        """No request in any replica's books or rows (a cancel its leader owes holds one), and none
        starting or restarting: a restart with empty books is a stall, not idle time."""
        return not any(r.rows_taken() or r.state in ("starting", "restarting") for r in self.replicas)

    def in_flight(self) -> list[int]:
        """Streaming requests in flight on each replica."""
        return [len(r.streams) for r in self.replicas]

    def serving(self) -> int:
        """Replicas that are serving or will be again (restarting)."""
        return sum(r.state in ("serving", "restarting", "starting") for r in self.replicas)

    def status(self) -> list[dict]:
        return [r.status() for r in self.replicas]

    def compile_stats(self) -> list[tuple[dict | None, dict | None]]:
        """Per serving replica: rank 0's compile stats when its current group was loaded, and now."""
        out = []
        for replica in self.replicas:
            started = replica.started
            if replica.state != "serving" or started is None:
                continue
            at_load = started.load_stats[0].compile if started.load_stats else None
            # graphs a warm-up built while the serving loop was prepared are the start's, not the requests'
            out.append((started.serving_compile or at_load, started.group.compile_stats()))
        return out

    def _replica_failed(self, replica: Replica) -> None:
        with self._lock:
            if self.serving() > 0:
                return
            reasons = "; ".join(f"replica {r.index}: {r.failure}" for r in self.replicas if r.failure)
            self._no_replica = NoReplicaAvailable(
                f"no replica is left to serve requests ({reasons}). Fix the cluster (ray status) and start "
                f"again (a new Launcher; under Ray Serve the server's replica is replaced)")
            self._drain(self._no_replica)

    def _drain(self, error: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _fail(item, type(error)(str(error)) if isinstance(error, LaunchError) else error)

    @property
    def stopping(self) -> bool:
        """shutdown() has begun (set under the pool's lock)."""
        return self._stopped.is_set()

    # ---- teardown ----------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 10.0) -> None:
        """Fail what is queued, stop every group (patiently, then by force), end the threads."""
        with self._lock:
            self._stopped.set()
            self._drain(LaunchError("the launcher was shut down before this request ran"))
        for replica in self.replicas:
            for handle in replica._take_streams():
                handle.fail(LaunchError("the launcher was shut down while this request was streaming"))
        for _ in self.replicas:
            self._queue.put(_STOP)
        stoppers = []
        for replica in self.replicas:
            if replica.started is not None:
                t = threading.Thread(target=replica.started.group.shutdown, args=(grace_s,), daemon=True)
                t.start()
                stoppers.append(t)
        for t in stoppers:
            t.join(grace_s + 5)
        # A start() cut short on the caller's thread (Ctrl-C or SIGTERM while the groups loaded)
        # left its threads placing and loading: their group sees the stop at its next poll (half a
        # second) and kills itself. Ray closed under them before that ended the whole process
        # inside Ray (exit 1, no message, at times Ray's agents left running).
        deadline = time.monotonic() + grace_s + START_THREAD_STOP_S
        for t in self._start_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for replica in self.replicas:
            if replica.started is not None:
                replica.started.group.kill()
            if replica._thread is not None:
                replica._thread.join(grace_s)
            if replica.started is not None:  # a restart that finished meanwhile installed a new group
                replica.started.group.kill()
            if replica.state != "failed":
                replica.state = "stopped"


# Each item is held by exactly one replica thread (or drained from the queue once), so its future is
# set exactly once; a second answer would raise InvalidStateError instead of passing silently. A
# future the caller cancelled while it was queued needs no answer.
def _succeed(item: _Item, value) -> None:
    item.future.set_result(value)


def _fail(item: _Item, error: BaseException) -> None:
    if not item.future.cancelled():
        item.future.set_exception(error)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
