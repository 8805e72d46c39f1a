"""launcher/cluster/replica_pool.py on its own: queueing, routing, restarts, failures, teardown.

The pool is driven through its GroupFactory seam with scripted in-process groups (what a TPGroup is
to the pool: generate, kill, shutdown, dead_ranks, workers, actors), so every decision of the pool
is checked in milliseconds. The same logic with real Ray workers (a SIGKILLed rank, a crash loop)
is in tests/test_fault_tolerance.py and tests/test_launcher_failures.py (slow).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest

from launcher.cluster.replica_pool import ReplicaPool, StartedGroup
from launcher.cluster.restart_policy import RestartPolicy
from launcher.errors import (LaunchError, NoReplicaAvailable, PlacementTimeout, QueueFull, RendezvousTimeout,
                             ReplicaFailed,
                             RequestTimeout, RestartLimitExceeded, WorkerDied)

TIMEOUT_S = 10


class ScriptedGroup:
    """One started TP group. Each request is answered by `script(request)` (its return value, or
    the error it raises); `gate` (when set) holds every request until it is opened."""

    def __init__(self, name: str, script=None, gate: threading.Event | None = None) -> None:
        self.name, self.script, self.gate = name, script or (lambda request: f"{name}:{request}"), gate
        self.actors = [f"{name}/rank0", f"{name}/rank1"]
        self.workers = [{"rank": 0, "pid": 100, "node_id": "node-a"}, {"rank": 1, "pid": 101, "node_id": "node-b"}]
        self.seen: list = []
        self.cancelled: list[list[str]] = []
        self.running = 0
        self.max_running = 0
        self.dead: list[str] = []
        self.killed = self.shut_down = False
        self._lock = threading.Lock()

    def generate(self, request):
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.seen.append(request)
        try:
            if self.gate is not None:
                assert self.gate.wait(TIMEOUT_S), "the test never opened the gate"
            return self.script(request)
        finally:
            with self._lock:
                self.running -= 1

    def dead_ranks(self, timeout_s: float = 5.0) -> list[str]:
        return list(self.dead)

    def submit(self, requests) -> None:  # a stream handed to rank 0 (its events are not scripted)
        self.seen.extend(requests)

    def cancel(self, request_ids) -> None:
        self.cancelled.append(list(request_ids))

    def poll(self, wait_s: float):  # a leader with no events to send
        return [], {}, {}

    def kill(self) -> None:
        self.killed = True
        self.actors = []

    def shutdown(self, grace_s: float = 10.0) -> None:
        self.shut_down = True
        self.kill()

    def node_groups(self) -> list[list[int]]:
        return [[0], [1]]


class Factory:
    """The pool's GroupFactory: each call returns a new group for that replica. `plan[index]`
    optionally lists, per start of that replica in turn, an exception to raise instead or a
    function returning the new group's script (a fresh one per group)."""

    def __init__(self, plan: dict | None = None, gate: threading.Event | None = None) -> None:
        self.plan = {k: list(v) for k, v in (plan or {}).items()}
        self.gate = gate
        self.calls: list[tuple[int, bool]] = []
        self.groups: dict[int, list[ScriptedGroup]] = {}

    def __call__(self, index: int, restart: bool) -> StartedGroup:
        self.calls.append((index, restart))
        step = self.plan.get(index, []).pop(0) if self.plan.get(index) else None
        if isinstance(step, BaseException):
            raise step
        group = ScriptedGroup(f"r{index}.{len(self.groups.get(index, []))}", script=step() if step else None,
                              gate=self.gate)
        self.groups.setdefault(index, []).append(group)
        return StartedGroup(group=group, load_stats=[])


def dies_once(message: str = "rank 1 (node n1, pid 7) died while trying to finish the request"):
    """A script whose first request fails as a dead rank does; later ones are answered."""
    calls = []

    def script(request):
        calls.append(request)
        if len(calls) == 1:
            raise WorkerDied(message)
        return f"after restart:{request}"

    return lambda: script


def always(error: BaseException):
    def script(request):
        raise error

    return script


@pytest.fixture
def make_pool():
    pools = []

    def make(count=1, factory=None, max_restarts=3, window_s=600.0, interval_s=30.0, notes=None):
        pool = ReplicaPool(count, factory or Factory(), lambda: RestartPolicy(max_restarts, window_s),
                           health_check_interval_s=interval_s,
                           note=notes.append if notes is not None else None)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown(grace_s=1)


def results(futures) -> list:
    return [f.result(timeout=TIMEOUT_S) for f in futures]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {TIMEOUT_S} s"
        time.sleep(0.005)


# ---- routing --------------------------------------------------------------------------------
def test_one_replica_serves_its_queue_in_order_one_request_at_a_time(make_pool):
    factory = Factory()
    pool = make_pool(1, factory)
    pool.start()
    answers = results([pool.submit(i) for i in range(6)])
    [group] = factory.groups[0]
    assert [a.outputs for a in answers] == [f"r0.0:{i}" for i in range(6)]
    assert {(a.replica, a.attempts) for a in answers} == {(0, 1)}
    assert group.seen == list(range(6)) and group.max_running == 1
    assert pool.status()[0]["served"] == 6 and factory.calls == [(0, False)]


def test_a_request_goes_to_an_idle_replica_never_behind_a_busy_one(make_pool):
    slow = threading.Event()
    factory = Factory({0: [lambda: lambda r: (slow.wait(TIMEOUT_S), f"slow:{r}")[1]]})
    pool = make_pool(2, factory)
    pool.start()
    # Replica 1 answers at once and replica 0 holds what it takes: send requests one by one until
    # replica 0 has taken one.
    while True:
        held = pool.submit("held")
        wait_for(lambda: held.done() or pool.status()[0]["busy"], "an answer or replica 0 taking it")
        if not held.done():
            break
    others = results([pool.submit(f"next{i}") for i in range(4)])
    assert {a.replica for a in others} == {1}  # all served while replica 0 was busy
    assert [a.outputs for a in others] == [f"r1.0:next{i}" for i in range(4)]
    assert not held.done()
    slow.set()
    assert held.result(TIMEOUT_S).replica == 0 and held.result().outputs == "slow:held"


def test_concurrent_requests_use_every_replica_and_each_gets_its_own_answer(make_pool):
    gate = threading.Event()
    factory = Factory(gate=gate)
    pool = make_pool(3, factory)
    pool.start()
    futures = [pool.submit(i) for i in range(9)]
    wait_for(lambda: sum(s["busy"] for s in pool.status()) == 3, "all three replicas busy")
    gate.set()
    answers = results(futures)
    assert [a.outputs.split(":")[1] for a in answers] == [str(i) for i in range(9)]
    assert {a.replica for a in answers} == {0, 1, 2}
    assert sum(s["served"] for s in pool.status()) == 9
    assert all(g.max_running == 1 for groups in factory.groups.values() for g in groups)


# ---- faults and restarts ----------------------------------------------------------------------
def test_a_dead_rank_restarts_the_group_and_reruns_the_request(make_pool):
    notes: list[str] = []
    factory = Factory({0: [dies_once()]})
    pool = make_pool(1, factory, max_restarts=2, notes=notes)
    pool.start()
    answer = pool.submit("a").result(TIMEOUT_S)
    old, new = factory.groups[0]
    assert answer.attempts == 2 and answer.outputs == "r0.1:a"  # re-run on the restarted group
    assert old.killed and not new.killed and factory.calls == [(0, False), (0, True)]
    [status] = pool.status()
    assert status["state"] == "serving" and status["restarts"] == 1 and status["last_recovery_s"] >= 0
    assert any("replica 0: WorkerDied: rank 1" in n and "restart 1 of at most 2" in n for n in notes), notes
    assert pool.submit("b").result(TIMEOUT_S).attempts == 1


GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 2000ms for recv operation to complete")


def test_a_restart_note_quoting_bracketed_text_is_printed_as_is_and_the_group_restarts(capsys):
    """A frozen node's gloo timeout begins "[/__w/...]": the restart note printed it as rich markup,
    raised MarkupError, and the replica was given up ("stopped on an unexpected error") instead of
    restarted, whenever progress output was on (corelaunch generate's default)."""
    from launcher.progress import Progress

    factory = Factory({0: [dies_once(GLOO_TIMEOUT)]})
    pool = ReplicaPool(1, factory, lambda: RestartPolicy(2, 600.0), health_check_interval_s=30.0,
                       note=Progress(True).note)
    try:
        pool.start()
        answer = pool.submit("a").result(TIMEOUT_S)
    finally:
        pool.shutdown(grace_s=1)
    assert answer.attempts == 2
    assert "[/__w/pytorch/pytorch/third_party/gloo" in capsys.readouterr().err


def test_a_note_that_fails_to_print_never_ends_the_replica(make_pool):
    """A note's printer raising (a closed stderr) ended the replica thread's loop: the replica was
    given up with its requests failed; the note is dropped instead."""
    def broken(text: str) -> None:
        raise BrokenPipeError("stderr closed")

    factory = Factory({0: [dies_once()]})
    pool = ReplicaPool(1, factory, lambda: RestartPolicy(2, 600.0), health_check_interval_s=30.0, note=broken)
    try:
        pool.start()
        assert pool.submit("a").result(TIMEOUT_S).attempts == 2
    finally:
        pool.shutdown(grace_s=1)


def test_progress_prints_every_text_as_it_is(capsys):
    """Step names and notes hold paths and quoted errors: "[/x]" or "[bold]" in them is text."""
    from launcher.progress import Progress

    progress = Progress(True)
    with progress.step("loading /models/[v2]/m"):
        pass
    progress.note("[/x] ended [bold]here[/bold]")
    err = capsys.readouterr().err
    assert "loading /models/[v2]/m" in err and "[/x] ended [bold]here[/bold]" in err


def test_a_crash_loop_stops_at_the_restart_bound_and_then_nothing_is_served(make_pool):
    crash = lambda: always(WorkerDied("rank 0 (node n1, pid 9) died while trying to finish the request"))  # noqa: E731
    factory = Factory({0: [crash] * 5})
    pool = make_pool(1, factory, max_restarts=2, window_s=120)
    pool.start()
    with pytest.raises(RestartLimitExceeded) as info:
        pool.submit("a").result(TIMEOUT_S)
    message = str(info.value)
    assert "replica 0 failed and is given up" in message and "already restarted 2 times within 120 s" in message
    assert "max_restarts=2" in message and "crash loop" in message and "rank 0 (node n1" in message, message
    assert isinstance(info.value.__cause__, WorkerDied)
    [status] = pool.status()
    assert status["state"] == "failed" and status["restarts"] == 2 and status["workers"] == []
    assert factory.calls == [(0, False), (0, True), (0, True)]
    assert all(g.killed for g in factory.groups[0])
    with pytest.raises(NoReplicaAvailable, match="no replica is left to serve requests"):
        pool.submit("b")


def test_restarts_disabled_fail_the_request_naming_the_setting(make_pool):
    factory = Factory({0: [dies_once()]})
    pool = make_pool(1, factory, max_restarts=0)
    pool.start()
    with pytest.raises(ReplicaFailed) as info:
        pool.submit("a").result(TIMEOUT_S)
    assert "restarts are disabled (max_restarts=0" in str(info.value)
    assert isinstance(info.value.__cause__, WorkerDied) and factory.calls == [(0, False)]


def test_a_timed_out_request_fails_but_its_group_is_restarted_for_the_next(make_pool):
    factory = Factory({0: [lambda: always(RequestTimeout("rank 0 did not finish the request within 5 s"))]})
    pool = make_pool(1, factory)
    pool.start()
    with pytest.raises(RequestTimeout, match="within 5 s"):
        pool.submit("long").result(TIMEOUT_S)  # not re-run: it would time out again
    assert pool.submit("next").result(TIMEOUT_S).outputs == "r0.1:next"
    assert pool.status()[0]["restarts"] == 1


def test_timed_out_batches_replace_their_group_without_using_up_the_restart_budget(make_pool):
    """A review: each static batch that outlasted its timeout counted as a restart, so a group merely
    slow on long batches was given up as a crash loop after max_restarts of them, and every later
    request failed with NoReplicaAvailable. A failure while starting the new group still counts."""
    slow = lambda: always(RequestTimeout("rank 0 did not finish the request within 1 s"))  # noqa: E731
    pool = make_pool(1, Factory({0: [slow, slow, slow]}), max_restarts=1)
    pool.start()
    for attempt in range(3):
        with pytest.raises(RequestTimeout, match="within 1 s"):
            pool.submit(f"long{attempt}").result(TIMEOUT_S)
    assert pool.submit("next").result(TIMEOUT_S).outputs == "r0.3:next"
    assert pool.status()[0]["restarts"] == 3 and pool.replicas[0].policy.recent() == 0
    dying = WorkerDied("rank 1 died while loading its shard")
    pool = make_pool(1, Factory({0: [slow, dying, dying]}), max_restarts=1)
    pool.start()
    with pytest.raises(RequestTimeout):
        pool.submit("long").result(TIMEOUT_S)
    with pytest.raises(NoReplicaAvailable, match="crash loop"):  # the new group's failures are counted
        pool.submit("next").result(TIMEOUT_S)
    pool = make_pool(1, Factory({0: [slow]}), max_restarts=0)  # 0: restarts off, a timeout's replacement too
    pool.start()
    with pytest.raises(RequestTimeout):
        pool.submit("long").result(TIMEOUT_S)
    with pytest.raises(NoReplicaAvailable, match="restarts are disabled"):
        pool.submit("next").result(TIMEOUT_S)


def test_a_group_that_cannot_be_placed_again_fails_its_replica_only(make_pool):
    gate = threading.Event()
    placement = PlacementTimeout("Ray could not reserve 2 bundles of {'CPU': 1}")
    factory = Factory({0: [dies_once(), placement]}, gate=gate)
    pool = make_pool(2, factory)
    pool.start()
    futures = [pool.submit(i) for i in range(2)]
    wait_for(lambda: all(s["busy"] for s in pool.status()), "both replicas busy")
    gate.set()
    done, _ = wait(futures, timeout=TIMEOUT_S)
    failed = [f for f in done if f.exception() is not None]
    assert len(done) == 2 and len(failed) == 1
    error = failed[0].exception()
    assert isinstance(error, ReplicaFailed) and "cannot host it any more" in str(error)
    assert "Ray could not reserve" in str(error) and error.__cause__ is placement
    assert [s["state"] for s in pool.status()] == ["failed", "serving"]
    assert pool.serving() == 1
    later = results([pool.submit(i) for i in range(3)])
    assert {a.replica for a in later} == {1}  # the survivor takes everything


def test_a_rank_that_dies_again_while_restarting_counts_as_another_failure(make_pool):
    notes: list[str] = []
    rejoin = RendezvousTimeout("rank 1 did not join the process group")
    factory = Factory({0: [dies_once(), rejoin]})
    pool = make_pool(1, factory, max_restarts=3, notes=notes)
    pool.start()
    answer = pool.submit("a").result(TIMEOUT_S)
    assert answer.attempts == 2 and answer.outputs == "r0.1:a"
    assert factory.calls == [(0, False), (0, True), (0, True)] and pool.status()[0]["restarts"] == 2
    assert any("RendezvousTimeout: rank 1 did not join" in n for n in notes), notes


def test_a_restart_that_fails_otherwise_gives_the_replica_up(make_pool):
    factory = Factory({0: [dies_once(), OSError("disk gone")]})
    pool = make_pool(1, factory)
    pool.start()
    with pytest.raises(ReplicaFailed, match=r"could not be restarted: OSError: disk gone"):
        pool.submit("a").result(TIMEOUT_S)
    assert pool.status()[0]["state"] == "failed"


def test_a_bad_request_fails_alone_and_the_group_keeps_serving(make_pool):
    def script(request):
        if request == "bad":
            raise ValueError("prompt 0 holds token ids [500] outside the vocabulary [0, 128)")
        return f"ok:{request}"

    factory = Factory({0: [lambda: script]})
    pool = make_pool(1, factory)
    pool.start()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pool.submit("bad").result(TIMEOUT_S)
    assert pool.submit("good").result(TIMEOUT_S).outputs == "ok:good"
    assert factory.calls == [(0, False)] and pool.status()[0]["restarts"] == 0


def test_an_error_that_took_the_group_down_restarts_it(make_pool):
    factory = Factory()

    def script_for_first_group(request):
        factory.groups[0][0].kill()  # e.g. a rank failed (RankFailed) and the group stopped itself
        raise RuntimeError("rank 0 failed to finish the request")

    factory.plan = {0: [lambda: script_for_first_group]}
    pool = make_pool(1, factory)
    pool.start()
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        pool.submit("a").result(TIMEOUT_S)
    wait_for(lambda: factory.calls == [(0, False), (0, True)], "the restart")
    assert pool.submit("b").result(TIMEOUT_S).outputs == "r0.1:b"


def broken_health_check(timeout_s: float = 5.0):
    raise RuntimeError("the GCS did not answer")


@pytest.mark.parametrize("breakage", ["a dead rank", "a check that raises"])
def test_an_idle_replica_whose_health_check_fails_is_restarted(make_pool, breakage):
    factory = Factory()
    pool = make_pool(1, factory, interval_s=0.02)
    pool.start()
    [first] = factory.groups[0]
    if breakage == "a dead rank":
        first.dead = ["rank 1 (node n2, pid 8)"]
    else:  # never a silent end of the replica's thread
        first.dead_ranks = broken_health_check
    wait_for(lambda: len(factory.groups[0]) == 2 and pool.status()[0]["state"] == "serving",
             "the health check's restart")
    assert first.killed and pool.status()[0]["restarts"] == 1
    assert pool.submit("x").result(TIMEOUT_S).outputs == "r0.1:x"


def test_a_timed_out_request_is_reported_before_its_group_restarts(make_pool):
    gate = threading.Event()
    factory = Factory({0: [lambda: always(RequestTimeout("rank 0 did not finish the request within 5 s")),
                           None]})
    real_call = factory.__call__

    def restarting(index, restart):
        if restart:
            assert gate.wait(TIMEOUT_S), "the test never let the restart finish"
        return real_call(index, restart)

    pool = make_pool(1, restarting)
    pool.start()
    with pytest.raises(RequestTimeout):
        pool.submit("long").result(TIMEOUT_S)  # answered while the restart is still held
    assert pool.status()[0]["state"] == "restarting"
    gate.set()
    assert pool.submit("next").result(TIMEOUT_S).outputs == "r0.1:next"


def one_request_held(make_pool, request: str):
    """A one-replica pool whose group holds every request until the returned gate opens, with
    `request` already running: (gate, factory, pool, that request's future)."""
    gate = threading.Event()
    factory = Factory(gate=gate)
    pool = make_pool(1, factory)
    pool.start()
    running = pool.submit(request)
    wait_for(lambda: factory.groups[0][0].running == 1, "the first request to start")
    return gate, factory, pool, running


def test_a_queued_request_cancelled_by_its_caller_never_runs(make_pool):
    gate, factory, pool, running = one_request_held(make_pool, "first")
    queued = pool.submit("second")
    assert queued.cancel()  # what generate() does on Ctrl-C
    gate.set()
    assert running.result(TIMEOUT_S).outputs == "r0.0:first"
    assert pool.submit("third").result(TIMEOUT_S).outputs == "r0.0:third"
    assert factory.groups[0][0].seen == ["first", "third"]


def test_a_request_whose_restart_is_cut_short_by_shutdown_fails_with_a_launch_error(make_pool):
    """The group died, its restart was under way when the launcher was shut down: the request fails
    naming the shutdown (it was answered with no error at all, and generate() then broke on it)."""
    release, started_again = threading.Event(), threading.Event()

    class SlowRestart(Factory):
        def __call__(self, index, restart):
            if restart:
                started_again.set()
                assert release.wait(TIMEOUT_S), "the test never released the restart"
            return super().__call__(index, restart)

    factory = SlowRestart({0: [dies_once()]})
    pool = make_pool(1, factory)
    pool.start()
    running = pool.submit("a")
    assert started_again.wait(TIMEOUT_S)
    stopper = threading.Thread(target=pool.shutdown, kwargs={"grace_s": 1})
    stopper.start()
    wait_for(lambda: pool.stopping, "the shutdown")
    release.set()
    with pytest.raises(LaunchError, match="shut down while this request was running"):
        running.result(TIMEOUT_S)
    stopper.join(TIMEOUT_S)
    assert factory.groups[0][1].killed  # the group started for nothing is stopped


def stream_handle(request_id: str):
    from launcher.cluster.stream_handle import StreamHandle
    from tests.serving_driver import request

    return StreamHandle(request(request_id, [1, 2], 4), lambda event: None, TIMEOUT_S)


def test_ids_awaiting_a_cancel_on_a_replica_given_up_are_free_again(make_pool):
    """A timed-out id waits for its leader's answer; once its replica is given up no answer will
    come, and the id must serve on another replica (it was refused for good)."""
    pool = make_pool(2)
    pool.start()
    failing = pool.replicas[0]
    failing.cancelling.add("r")  # as a stream that timed out there leaves it
    with pytest.raises(ValueError, match=r"request_id 'r' belongs to a request that has ended here \(closed, timed "
                                         r"out, or finished on a stop string"):
        pool.submit_stream(stream_handle("r"))
    failing._give_up(ReplicaFailed("replica 0 is gone"), WorkerDied("rank 0 died"))
    handle = stream_handle("r")
    pool.submit_stream(handle)
    assert handle.replica == 1 and handle.attempts == 1
    assert [r.request_id for r in factory_seen(pool, 1)] == ["r"]


def test_a_stream_submitted_while_its_replica_restarts_counts_one_attempt(make_pool):
    """It waits for the restarted group, which takes it first: one hand-over, not a re-run."""
    pool = make_pool(1)
    pool.start()
    replica = pool.replicas[0]
    replica.state = "restarting"  # as inside _restart, before the new group serves
    handle = stream_handle("w")
    pool.submit_stream(handle)
    assert handle.attempts == 0 and factory_seen(pool, 0) == []
    with replica._streams_lock:
        replica.state = "serving"
        replica._resume_streams()
    assert handle.attempts == 1 and [r.request_id for r in factory_seen(pool, 0)] == ["w"]


def test_a_calls_prompts_get_the_waves_they_wait_for_on_the_replica_they_go_to(make_pool):
    """generate's prompts while one replica restarts all go to the other: their timeouts were sized
    as if spread over both (a prompt four waves deep had two timeouts and failed on a healthy group)."""
    pool = make_pool(2)
    pool.start()
    pool.replicas[1].state = "restarting"  # as inside _restart: the serving replica takes everything
    handles = [stream_handle(f"p{i}") for i in range(5)]
    pool.submit_streams(handles, rows=2, timeout_per_wave=True)
    assert [h.replica for h in handles] == [0] * 5
    assert [h.timeout_s / TIMEOUT_S for h in handles] == [1, 1, 2, 2, 3]
    assert all(h.deadline == h.submitted + h.timeout_s for h in handles)
    pool.replicas[1].state = "serving"
    alone = stream_handle("s")  # a request of its own keeps one timeout wherever it waits
    pool.submit_streams([alone], rows=2)
    assert alone.timeout_s == TIMEOUT_S


def factory_seen(pool, index):
    return pool.replicas[index].started.group.seen


def test_the_queue_limit_refuses_only_a_request_that_would_wait_and_admits_a_batch_whole(make_pool):
    """max_queued_requests counts requests waiting for a row. It refused every request at 0, and a
    request routed to a replica with a free row whenever requests waited elsewhere."""
    pool = make_pool(2)
    pool.start()
    pool.submit_stream(stream_handle("a"), queue_limit=0, rows=1)  # a row each: nothing waits
    pool.submit_stream(stream_handle("b"), queue_limit=0, rows=1)
    assert pool.in_flight() == [1, 1]
    # "0 requests already wait" read as if nothing waited; the fix names the fields and the flags
    with pytest.raises(QueueFull, match=r"every sequence slot is busy \(max_num_seqs 1 per replica\) and none may "
                                        r"wait for one \(max_queued_requests 0\); retry later, or raise "
                                        r"max_queued_requests or max_num_seqs \(--max-queued-requests") as full:
        pool.submit_stream(stream_handle("c"), queue_limit=0, rows=1)
    assert (full.value.slots, full.value.queue_limit) == (1, 0)
    pool.submit_stream(stream_handle("c"), queue_limit=1, rows=1)  # waits on replica 0
    assert pool.in_flight() == [2, 1]
    pool.replicas[1].streams.pop("b")  # finished: replica 1 has a free row while "c" still waits
    pool.submit_stream(stream_handle("d"), queue_limit=1, rows=1)
    assert pool.in_flight() == [2, 1]  # it went to the free row
    with pytest.raises(QueueFull, match=r"1 requests already wait for one \(max_queued_requests 1\)"):  # the first would wait: none submitted
        pool.submit_streams([stream_handle("e"), stream_handle("f")], queue_limit=1, rows=1)
    assert pool.in_flight() == [2, 1]
    pool.submit_streams([stream_handle("e"), stream_handle("f")], queue_limit=2, rows=1)  # both, past the limit
    assert sorted(pool.in_flight()) == [2, 3]
    with pytest.raises(ValueError, match="request_id 'g' is already in flight"):
        pool.submit_streams([stream_handle("g"), stream_handle("g")])
    assert sum(pool.in_flight()) == 5


def test_a_stream_arriving_as_the_last_replica_is_given_up_is_told_no_replica_is_left(make_pool):
    """Between a replica's state turning failed and the pool noting that none is left, a stream
    found no candidate: min() of nothing raised a ValueError, which the server sent as a 400 about
    the prompt."""
    pool = make_pool(1)
    pool.start()
    pool.replicas[0].state = "failed"  # the window inside _give_up, before _replica_failed
    with pytest.raises(NoReplicaAvailable, match="no replica is left to serve requests"):
        pool.submit_stream(stream_handle("s"))


# ---- start, status, shutdown ---------------------------------------------------------------------
def test_a_replica_that_fails_to_start_fails_the_start_and_stops_the_others(make_pool):
    factory = Factory({1: [PlacementTimeout("no room for replica 1")]})
    pool = make_pool(3, factory)
    with pytest.raises(PlacementTimeout, match="no room for replica 1") as info:
        pool.start()
    assert "(replica 1 of 3, the first whose start failed; 1 replica(s) failed to start)" in info.value.__notes__
    assert sorted(factory.calls) == [(0, False), (1, False), (2, False)]
    assert all(g.shut_down for i in (0, 2) for g in factory.groups[i])
    with pytest.raises(LaunchError, match="shut down"):
        pool.submit("a")


def test_a_failed_start_stops_the_others_and_names_the_first_failure(make_pool):
    """A review: one replica's failed start was raised only once every other replica had loaded and
    warmed up, groups about to be killed. start_failed stops them at their next check (the Launcher's
    groups read it as a stop asked), and the error raised is the failure's, not a stopped replica's."""
    factory = Factory({1: [RendezvousTimeout("rank 1 of replica 1 never joined")]})

    def make_group(index, restart):
        if index == 0:  # loading slowly: stops once another replica's start has failed
            assert pool.start_failed.wait(TIMEOUT_S), "start_failed was never set"
            raise LaunchError("the launcher was shut down while this group started; the group was stopped")
        return factory(index, restart)

    pool = make_pool(2, make_group)
    with pytest.raises(RendezvousTimeout, match="never joined") as info:
        pool.start()
    assert "(replica 1 of 2, the first whose start failed; 2 replica(s) failed to start)" in info.value.__notes__


def test_status_reports_workers_nodes_and_counters(make_pool):
    pool = make_pool(2)
    pool.start()
    pool.submit("a").result(TIMEOUT_S)
    status = pool.status()
    assert [s["index"] for s in status] == [0, 1]
    assert all(s["state"] == "serving" and s["nodes"] == ["node-a", "node-b"] for s in status)
    assert all(s["node_groups"] == [[0], [1]] and [w["rank"] for w in s["workers"]] == [0, 1] for s in status)
    assert sum(s["served"] for s in status) == 1 and all(s["failure"] is None for s in status)


def test_shutdown_fails_what_is_queued_and_stops_every_group(make_pool):
    gate, factory, pool, running = one_request_held(make_pool, "running")
    queued = [pool.submit(i) for i in range(3)]
    stopper = threading.Thread(target=pool.shutdown, kwargs={"grace_s": 1})
    stopper.start()
    for future in queued:
        with pytest.raises(LaunchError, match="shut down before this request ran"):
            future.result(TIMEOUT_S)
    gate.set()
    stopper.join(TIMEOUT_S)
    assert running.done()
    [group] = factory.groups[0]
    assert group.shut_down and group.seen == ["running"]
    assert pool.status()[0]["state"] == "stopped"
    with pytest.raises(LaunchError, match="the launcher is shut down"):
        pool.submit("late")


def test_at_least_one_replica():
    with pytest.raises(ValueError, match=r"replicas \(0\) must be at least 1"):
        ReplicaPool(0, Factory(), RestartPolicy)


def test_a_replica_started_while_the_pool_shuts_down_is_killed_not_kept(make_pool):
    """Ctrl-C during start(): shutdown() ran while a group was still being made, found no group to
    stop, and the group then joined the pool as serving and outlived the launcher."""
    release, making = threading.Event(), threading.Event()
    factory = Factory()

    def slow_factory(index, restart):
        making.set()
        assert release.wait(TIMEOUT_S)
        return factory(index, restart)

    pool = make_pool(factory=slow_factory)
    errors = []
    starter = threading.Thread(target=lambda: _record(errors, pool.start), daemon=True)
    starter.start()
    assert making.wait(TIMEOUT_S)
    # The group finishes while shutdown() waits for the start's thread (it finished after the
    # shutdown had looked for groups to stop, before that wait came in).
    threading.Timer(0.2, release.set).start()
    pool.shutdown(grace_s=0.1)  # what Launcher.start's handler does on KeyboardInterrupt
    starter.join(TIMEOUT_S)
    assert factory.groups[0][0].killed and pool.replicas[0].started is None
    assert errors and "shut down while this replica started" in str(errors[0])


def test_shutdown_returns_only_once_a_start_cut_short_has_stopped_its_threads(make_pool):
    """Ctrl-C or SIGTERM in start()'s joins: the launcher's shutdown (and then Ray's) ran while the
    start's threads still placed and loaded. Their groups stop at their next poll for a stop and
    kill their actors: Ray closed before that ended the whole process inside Ray (exit 1, no
    message). shutdown() now returns once those threads have ended."""
    stop_asked, making, gone = threading.Event(), threading.Event(), threading.Event()

    def polling_factory(index, restart):  # a TPGroup's waits: a poll for a stop, then its actors killed
        making.set()
        assert stop_asked.wait(TIMEOUT_S)
        time.sleep(0.3)  # killing the actors
        gone.set()
        raise LaunchError("the launcher was shut down while it started")

    pool = make_pool(count=2, factory=polling_factory)
    errors = []
    starter = threading.Thread(target=lambda: _record(errors, pool.start), daemon=True)
    starter.start()
    assert making.wait(TIMEOUT_S)
    stop_asked.set()  # Launcher.shutdown counts the stop before it stops the pool
    pool.shutdown(grace_s=0.1)
    assert gone.is_set(), "shutdown() returned while a start thread still used the cluster"
    starter.join(TIMEOUT_S)
    assert errors and "shut down while it started" in str(errors[0])


def test_a_restart_in_progress_when_the_pool_shuts_down_makes_no_further_group(make_pool):
    """Each restart attempt makes a group through Ray, which starts a new local Ray when the
    launcher has shut its own down: after shutdown no attempt may begin."""
    attempts, first_attempt, release = [], threading.Event(), threading.Event()
    factory = Factory({0: [dies_once()]})

    def restarting_factory(index, restart):
        if restart:
            attempts.append(index)
            first_attempt.set()
            assert release.wait(TIMEOUT_S)
            raise RendezvousTimeout("a rank did not join in time")  # would be retried
        return factory(index, restart)

    pool = make_pool(factory=restarting_factory, max_restarts=5)
    pool.start()
    future = pool.submit("a")
    assert first_attempt.wait(TIMEOUT_S)
    stopper = threading.Thread(target=pool.shutdown, kwargs={"grace_s": 2}, daemon=True)
    stopper.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not pool.stopping:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.set()
    stopper.join(TIMEOUT_S)
    wait([future], timeout=TIMEOUT_S)
    assert attempts == [0]  # the failed attempt was not retried after shutdown began
    with pytest.raises(LaunchError):
        future.result(timeout=0)


def _record(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the test reads it
        errors.append(err)


def test_a_restart_that_installs_its_group_as_the_pool_shuts_down_has_that_group_killed(make_pool):
    """A shutdown that lands after the restart's check of `stopping` but before it installs the new
    group killed the old group only: the new one answered, then outlived the launcher. The restart
    takes the replica's lock a little late here (as when a caller's submit or cancel holds it)."""
    made = threading.Event()
    factory = Factory({0: [dies_once()]})

    def marking_factory(index, restart):
        group = factory(index, restart)
        if restart:
            made.set()
        return group

    pool = make_pool(factory=marking_factory)
    pool.start()
    replica = pool.replicas[0]
    real, stoppers = replica._streams_lock, []

    class TakenLate:
        def __enter__(self):
            if made.is_set() and not stoppers and threading.current_thread() is replica._thread:
                stoppers.append(threading.Thread(target=pool.shutdown, kwargs={"grace_s": 1.0}, daemon=True))
                stoppers[0].start()
                deadline = time.monotonic() + TIMEOUT_S
                while not factory.groups[0][0].killed:  # the shutdown is past `stopping`: the old group killed
                    assert time.monotonic() < deadline, "the shutdown never killed the old group"
                    time.sleep(0.01)
                time.sleep(0.2)  # and on into its wait for this thread (a few statements on)
            return real.__enter__()

        def __exit__(self, *exc):
            return real.__exit__(*exc)

    replica._streams_lock = TakenLate()
    future = pool.submit("a")
    wait([future], timeout=TIMEOUT_S)
    assert made.wait(TIMEOUT_S) and stoppers
    stoppers[0].join(TIMEOUT_S)
    old, new = factory.groups[0]
    assert old.killed and new.killed, (old.killed, new.killed)


# ---- streams waiting for a row move to a free one ------------------------------------------------
def routed_three(make_pool):
    """Two replicas of one row each: s0 and s2 on replica 0 (s2 waiting behind s0), s1 on replica 1."""
    pool = make_pool(2)
    pool.start()
    handles = [stream_handle(f"s{i}") for i in range(3)]
    for handle in handles:
        pool.submit_streams([handle], rows=1)
    assert [h.replica for h in handles] == [0, 1, 0]
    return pool, handles


def finished_on(replica, handle) -> None:
    """As a finish event polled there takes a stream out of the books."""
    with replica._streams_lock:
        replica.streams.pop(handle.request_id)


def test_a_stream_waiting_for_a_row_moves_to_a_replica_whose_row_came_free(make_pool):
    """Counted at arrival, requests split evenly but lengths do not: a waiting request stayed
    behind a long one while the other replica idled (after a restart, behind everything the other
    replica took meanwhile)."""
    pool, (s0, s1, s2) = routed_three(make_pool)
    r0, r1 = pool.replicas
    r0._poll_streams(wait_s=0)  # every row busy: nothing moves
    assert s2.replica == 0 and r0.started.group.cancelled == []
    finished_on(r1, s1)
    r0._poll_streams(wait_s=0)
    assert s2.replica == 1 and set(r1.streams) == {"s2"} and set(r0.streams) == {"s0"}
    assert r0.started.group.cancelled == [["s2"]] and r0.cancelling == {"s2"}  # its late events are dropped
    assert [r.request_id for r in factory_seen(pool, 1)] == ["s1", "s2"]
    assert s2.attempts == 1  # a move is not a re-run
    assert pool.load(1) == {"running": 2, "waiting": 0}
    pool.cancel_stream(s2)  # its reader's cancel follows it
    assert r1.cancelling == {"s2"} and r1.started.group.cancelled == [["s2"]] and s2.cancelled and s2.closing


def test_a_stream_with_tokens_delivered_stays(make_pool):
    """Its tokens came from this group: moving it would resume it, which is a fault's business."""
    from workers.serving.requests import TokenEvent

    pool, (s0, s1, s2) = routed_three(make_pool)
    s2.deliver(TokenEvent("s2", [7]))
    finished_on(pool.replicas[1], s1)
    pool.replicas[0]._poll_streams(wait_s=0)
    assert s2.replica == 0 and pool.replicas[0].started.group.cancelled == []


def test_a_stream_is_not_moved_back_to_a_leader_that_still_owes_its_old_cancel(make_pool):
    """s2 moved from replica 0 to 1 (its cancel owed by 0's leader); 1's group fails, and 0 took it
    back at once: the old cancel's abort then took its id out of the ids 0's leader holds, so the
    reader's later cancel of the new run was never sent, and the leader ran it to max_tokens while
    the books counted its row free. It waits for that answer now."""
    from workers.serving.requests import TokenEvent

    pool, (s0, s1, s2) = routed_three(make_pool)
    r0, r1 = pool.replicas
    finished_on(r1, s1)
    r0._poll_streams(wait_s=0)  # s2 waited on r0: moved to r1, its cancel owed by r0's leader
    assert s2.replica == 1 and r0.cancelling == {"s2"}
    with r1._streams_lock:
        r1.state = "restarting"  # r1's group failed; s2 (nothing delivered) waits there
    finished_on(r0, s0)
    pool.rows = 2  # a row free on r0
    r0._take_from_restarting()
    assert s2.replica == 1 and "s2" not in r0.streams  # not while r0's leader owes its old cancel
    group = r0.started.group
    group.poll = lambda wait_s: ([TokenEvent("s2", [], "abort")], {}, {})  # the old cancel answered
    r0._poll_streams(wait_s=0)
    group.poll = lambda wait_s: ([], {}, {})
    assert r0.cancelling == set()
    r0._take_from_restarting()  # now it may come back
    assert s2.replica == 0 and "s2" in r0.streams
    before = list(group.cancelled)
    pool.cancel_stream(s2)  # the reader drops the new run: its cancel reaches the leader running it
    assert group.cancelled == before + [["s2"]]


def test_a_stream_cancelled_while_it_moves_is_not_handed_over(make_pool):
    pool, (s0, s1, s2) = routed_three(make_pool)
    finished_on(pool.replicas[1], s1)
    [moving] = pool.replicas[0]._give_away(1, taker=1, owed=set())
    pool.cancel_stream(moving)  # between leaving replica 0 and reaching replica 1
    assert moving.closing and not moving.cancelled  # in neither replica's books: no cancel reached one
    pool.replicas[1].submit_stream(moving, moved=True)
    assert "s2" not in pool.replicas[1].streams and [r.request_id for r in factory_seen(pool, 1)] == ["s1"]


def test_a_dropped_stream_whose_drop_reached_its_old_replica_is_cancelled_where_it_went(make_pool):
    """A finalizer read the replica before the move: its drop is passed on, not lost."""
    pool, (s0, s1, s2) = routed_three(make_pool)
    r0, r1 = pool.replicas
    finished_on(r1, s1)
    r0._poll_streams(wait_s=0)
    assert s2.replica == 1
    r0.dropped.put(s2)
    r0._poll_streams(wait_s=0)
    r1._poll_streams(wait_s=0)
    assert "s2" not in r1.streams and r1.started.group.cancelled == [["s2"]]


def test_no_stream_moves_into_rows_held_by_cancels_their_leader_has_not_answered(make_pool):
    """A review: a leader stuck in a step, whose readers had all given up, had empty books but held
    every row; a request waiting on a healthy replica was moved there and timed out."""
    pool, (s0, s1, s2) = routed_three(make_pool)
    r0, r1 = pool.replicas
    finished_on(r1, s1)
    r1.cancelling.add("gave-up")  # its reader closed it; the stuck leader never answered the cancel
    r0._poll_streams(wait_s=0)
    assert s2.replica == 0 and r0.started.group.cancelled == [] and r1.free_rows() == 0
    r1.cancelling.clear()  # the answer came
    r0._poll_streams(wait_s=0)
    assert s2.replica == 1


def test_new_streams_are_routed_by_rows_held_by_unanswered_cancels_too(make_pool):
    """A review: routing counted the books alone, so a replica whose leader had not answered its
    cancels (mid-step, or hung with every reader gone) looked empty, and took a new request while
    the other replica had a free row. The queue limit still goes by the books: a request that ended
    on a stop string is cancelled on its group, and the next must not be refused meanwhile."""
    pool = make_pool(2)
    pool.start()
    x, z, y = (stream_handle(name) for name in "xzy")
    for handle in (x, z, y):
        pool.submit_streams([handle], rows=2)
    assert [h.replica for h in (x, z, y)] == [0, 1, 0]
    pool.cancel_stream(x)
    pool.cancel_stream(y)  # both of replica 0's rows held, one of replica 1's free
    w = stream_handle("w")
    pool.submit_streams([w], rows=2)
    assert w.replica == 1
    after_stop = stream_handle("s")  # both rows now taken on both replicas, two by unanswered cancels
    pool.submit_streams([after_stop], queue_limit=0, rows=2)
    assert after_stop.replica == 0 and pool.in_flight() == [1, 2]


def test_streams_waiting_on_a_restarting_replica_run_at_once_on_one_with_a_free_row(make_pool):
    """A review: they waited for the whole restart (placement and loading) while the other replica
    idled. Those with tokens delivered stay for the restarted group to resume; the others move,
    counted as an attempt when their failed group had them."""
    from workers.serving.requests import TokenEvent

    pool, (s0, s1, s2) = routed_three(make_pool)
    r0, r1 = pool.replicas
    late = stream_handle("late")
    pool.submit_streams([late], rows=2)  # two rows a replica from now on: r1 has one free
    assert late.replica == 1
    finished_on(r1, s1)
    s0.deliver(TokenEvent("s0", [5]))
    r0.state = "restarting"  # as _restart sets it while the new group starts
    never = stream_handle("never")  # submitted during the restart: no group had it yet
    r0.submit_stream(never)
    r1._poll_streams(wait_s=0)
    assert set(r0.streams) == {"s0", "never"} and set(r1.streams) == {"late", "s2"}  # one free row: the oldest
    assert s2.replica == 1 and s2.attempts == 2 and s2.resumed_at == [0]
    finished_on(r1, late)
    r1._poll_streams(wait_s=0)
    assert set(r1.streams) == {"s2", "never"} and never.attempts == 1 and never.resumed_at == []
    assert set(r0.streams) == {"s0"}
    assert r0.started.group.cancelled == [] and not r0.cancelling  # no leader to tell: nothing owed
    with r0._streams_lock:  # the restart completes: only what stayed is resumed
        r0.state = "serving"
        r0._resume_streams()
    assert s0.attempts == 2 and [r.request_id for r in factory_seen(pool, 0)][-1] == "s0"


def the_shutdowns_stop_error() -> LaunchError:
    """What a restarting group raises once the launcher's shutdown has begun (launcher/api.py counts
    the stop before it tells the pool): made by a real TPGroup's own check, no Ray needed."""
    from launcher.cluster.resources import RankResources
    from launcher.cluster.tp_group import TPGroup

    group = TPGroup(tp_degree=1, backend="cpu", resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1))
    group.stop_asked = lambda: True
    with pytest.raises(LaunchError) as info:
        group._unless_stop_asked()
    return info.value


def test_a_restart_stopped_by_the_shutdown_gives_no_replica_up(make_pool):
    """A restart cut short by the shutdown before the pool heard of it is no failure of the
    replica: the request fails naming the shutdown, not "could not be restarted", and the pool does
    not fail its queue with "no replica is left ... Fix the cluster"."""
    factory = Factory({0: [dies_once(), the_shutdowns_stop_error()]})
    pool = make_pool(1, factory)
    pool.start()
    with pytest.raises(LaunchError, match="shut down while this request was running") as info:
        pool.submit("a").result(TIMEOUT_S)
    assert type(info.value) is LaunchError  # not a ReplicaFailed
    replica = pool.replicas[0]
    assert replica.failure is None and replica.state != "failed" and pool._no_replica is None


def test_streams_dropped_during_a_restart_are_not_resubmitted(make_pool):
    """A stream its reader dropped while the replica restarted (its cancel deferred to the next
    poll) would be prefilled on the new group only to be cancelled there: it is forgotten instead."""
    pool = make_pool(1)
    pool.start()
    replica = pool.replicas[0]
    replica.state = "restarting"  # as inside _restart, before the new group serves
    live, dropped = stream_handle("live"), stream_handle("dropped")
    pool.submit_streams([live, dropped])
    pool.cancel_stream(dropped, deferred=True)  # a reader garbage-collected meanwhile
    with replica._streams_lock:
        replica.state = "serving"
        replica._resume_streams()
    assert [r.request_id for r in factory_seen(pool, 0)] == ["live"]
    assert list(replica.streams) == ["live"] and dropped.cancelled
    replica.cancel_stream(dropped.request_id, only=dropped)  # the deferred cancel, at the next poll
    assert factory_seen(pool, 0)[-1].request_id == "live" and replica.started.group.cancelled == []


# ---- a replica given up, restart retries, ties, streams during the start -----------------------
def recording_handle(request_id: str, sink: list):
    from launcher.cluster.stream_handle import StreamHandle
    from tests.serving_driver import request

    return StreamHandle(request(request_id, [1, 2], 4), sink.append, TIMEOUT_S)


def test_a_replica_given_up_hands_its_streams_with_nothing_delivered_to_a_serving_one(make_pool):
    """A review: the restart limit failed every stream of the replica, those another replica could
    run from their prompt too (a restart in progress hands them over: _take_from_restarting)."""
    from workers.serving.requests import TokenEvent

    pool = make_pool(2, max_restarts=1)
    pool.start()
    r0, r1 = pool.replicas
    seen = {name: [] for name in ("s0", "s1", "s2")}
    s0, s1, s2 = handles = [recording_handle(name, seen[name]) for name in seen]
    for handle in handles:
        pool.submit_streams([handle], rows=4)
    assert [h.replica for h in handles] == [0, 1, 0]
    s2.deliver(TokenEvent("s2", [7]))  # its tokens came from replica 0's group: no other can go on
    r0.policy.allow()  # its one restart in the window is used up
    assert r0._restart(WorkerDied("rank 1 died")) is False and r0.state == "failed"
    assert isinstance(seen["s2"][-1], RestartLimitExceeded)
    assert seen["s0"] == [] and s0.replica == 1 and set(r1.streams) == {"s1", "s0"}
    assert [r.request_id for r in factory_seen(pool, 1)] == ["s1", "s0"]
    assert s0.attempts == 2 and s0.resumed_at == [0]  # its failed group had it: a second attempt
    assert r0.streams == {} and pool.serving() == 1


def _two_replicas_one_stream_on_the_first(make_pool):
    """A started pool of two replicas (one restart each), the events seen by stream "a" and "a",
    routed to replica 0."""
    pool = make_pool(2, max_restarts=1)
    pool.start()
    seen = []
    a = recording_handle("a", seen)
    pool.submit_streams([a], rows=4)
    assert a.replica == 0
    return pool, seen, a


@pytest.mark.parametrize("other", ["restarting", "starting"])
def test_a_replica_given_up_while_the_other_is_not_up_yet_hands_it_streams_with_nothing_delivered(make_pool, other):
    """A review: with no replica serving, they failed with RestartLimitExceeded, while a new request
    arriving then was routed to the other replica and ran once its group was up."""
    pool, seen, a = _two_replicas_one_stream_on_the_first(make_pool)
    r0, r1 = pool.replicas
    with r1._streams_lock:
        r1.state = other  # its group failed too and is being restarted, or is still starting
    r0.policy.allow()  # its one restart in the window is used up
    assert r0._restart(WorkerDied("rank 1 died")) is False and r0.state == "failed"
    late = stream_handle("late")
    pool.submit_streams([late], rows=4)
    assert late.replica == 1  # as a new request is routed
    assert seen == [] and a.replica == 1 and set(r1.streams) == {"a", "late"} and r0.streams == {}
    assert factory_seen(pool, 1) == []  # nothing handed over before the group is up
    if other == "restarting":  # the restart ends
        with r1._streams_lock:
            r1.state = "serving"
            r1._resume_streams()
    else:  # the start ends: its continuous-batching group is handed what was booked meanwhile
        r1.started.group.serving = True
        r1._begin_serving(r1.started)
    assert seen == [] and [r.request_id for r in factory_seen(pool, 1)] == ["a", "late"]
    assert a.attempts == 2  # its failed group had it: a second attempt


def test_a_restarting_taker_is_handed_a_stream_its_gone_leader_owed_a_cancel_for(make_pool):
    """A review: the cancel the restarting replica's old leader owed ruled the stream out, and it
    failed; that leader is gone, and the restart clears what it owed before its new group starts."""
    pool, seen, a = _two_replicas_one_stream_on_the_first(make_pool)
    r0, r1 = pool.replicas
    with r1._streams_lock:
        r1.cancelling.add("a")  # lent away from it earlier, its old leader still owing that cancel
        r1.state = "restarting"
    r0.policy.allow()
    assert r0._restart(WorkerDied("rank 1 died")) is False and r0.state == "failed"
    assert seen == [] and a.replica == 1 and set(r1.streams) == {"a"}


class StreamingFactory(Factory):
    """Continuous-batching groups (streams are handed to their leader) that also run static batches.
    A leader waits out each poll (no tokens to send), but one in `streaming` answers each at once
    (its streams' tokens keep coming), so its thread looks at the queue most often."""

    def __init__(self, plan: dict | None = None, streaming: tuple[int, ...] = ()) -> None:
        super().__init__(plan)
        self.streaming = streaming

    def __call__(self, index, restart):
        started = super().__call__(index, restart)
        started.group.serving = True
        answer_s = 0.001 if index in self.streaming else None
        started.group.poll = lambda wait_s: (time.sleep(answer_s or wait_s), ([], {}, {}))[1]
        return started


def streams_on(pool, counts: list[int]) -> None:
    """Book counts[i] streams on replica i (as routed there, still running)."""
    for index, count in enumerate(counts):
        for i in range(count):
            handle = stream_handle(f"r{index}s{i}")
            pool.replicas[index].submit_stream(handle)


def test_static_batches_on_streaming_replicas_go_to_the_least_loaded_one_not_busy(make_pool):
    """A review: each replica's thread took the next static batch whatever its streams, so batches
    landed on a replica full of streams (stalling them) while another one idled. Still, one busy
    with a long static batch is not waited for."""
    held = threading.Event()

    def long_one_held(request):
        if request == "long":
            assert held.wait(TIMEOUT_S), "the test never let the long batch end"
        return f"r1:{request}"

    pool = make_pool(2, StreamingFactory({1: [lambda: long_one_held]}))
    pool.start()
    streams_on(pool, [4, 0])
    went = [pool.submit(f"batch{i}").result(TIMEOUT_S).replica for i in range(10)]
    assert went == [1] * 10, went
    long = pool.submit("long")
    wait_for(lambda: pool.replicas[1].busy, "replica 1 taking the long batch")
    assert pool.submit("next").result(TIMEOUT_S).replica == 0  # not behind the long one
    held.set()
    assert long.result(TIMEOUT_S).outputs == "r1:long"


def test_static_batches_go_to_the_replicas_tied_for_the_least_streams(make_pool):
    """Replicas tied for the fewest take the batches (a tie must not leave a batch to none of them),
    the more loaded one none, though its thread, woken by its streams' tokens, looks at the queue
    most often."""
    pool = make_pool(3, StreamingFactory(streaming=(2,)))
    pool.start()
    streams_on(pool, [4, 4, 8])
    went = [pool.submit(f"batch{i}").result(TIMEOUT_S).replica for i in range(10)]
    assert set(went) <= {0, 1}, went


def test_failed_restart_attempts_wait_longer_each_time_and_the_first_is_at_once(make_pool, monkeypatch):
    """A review: after a failed attempt the next came at once, so a brief problem (a rank slow to
    join) used up max_restarts in milliseconds and the replica was given up."""
    import launcher.cluster.replica_pool as replica_pool

    monkeypatch.setattr(replica_pool, "RESTART_RETRY_FIRST_S", 0.1, raising=False)  # raising: the old code had none
    slow = RendezvousTimeout("rank 1 did not join the process group")
    factory = Factory({0: [dies_once(), slow, slow, slow]})
    times: list[float] = []
    making = factory.__call__

    def timed(index, restart):
        times.append(time.monotonic())
        return making(index, restart)

    pool = make_pool(1, timed, max_restarts=5)
    pool.start()
    sent = time.monotonic()
    answer = pool.submit("a").result(TIMEOUT_S)
    assert answer.outputs == "r0.1:a" and pool.status()[0]["restarts"] == 4
    first_restart, *retries = times[1:]
    assert first_restart - sent < 0.1  # the fault's own restart: no wait
    gaps = [b - a for a, b in zip([first_restart, *retries], retries)]
    assert len(gaps) == 3 and all(gap >= want for gap, want in zip(gaps, (0.1, 0.2, 0.4))), gaps


def test_a_restart_waiting_to_retry_stops_at_once_when_the_pool_shuts_down(make_pool):
    """The default wait (a second, then longer): the shutdown must not wait it out, nor a new group follow."""
    slow = RendezvousTimeout("rank 1 did not join the process group")
    factory = Factory({0: [dies_once(), slow, slow]})
    pool = make_pool(1, factory, max_restarts=5)
    pool.start()
    pending = pool.submit("a")
    wait_for(lambda: len(factory.calls) == 2, "the first restart attempt")
    time.sleep(0.2)  # it failed and waits
    assert len(factory.calls) == 2 and not pending.done()
    began = time.monotonic()
    pool.shutdown(grace_s=1)
    assert time.monotonic() - began < 1.0 and not pool.replicas[0]._thread.is_alive()
    assert len(factory.calls) == 2  # no attempt after the shutdown
    with pytest.raises(LaunchError):
        pending.result(TIMEOUT_S)


def test_streams_on_an_idle_pool_go_round_the_replicas(make_pool):
    """A review: min() took the first of equally loaded replicas, so one request at a time all went
    to replica 0."""
    pool = make_pool(3)
    pool.start()
    went = []
    for i in range(6):
        handle = stream_handle(f"q{i}")
        pool.submit_streams([handle], rows=4)
        went.append(handle.replica)
        finished_on(pool.replicas[handle.replica], handle)  # each ends before the next comes
    assert sorted(went) == [0, 0, 1, 1, 2, 2]


def test_a_stream_booked_while_its_group_starts_is_handed_over_once_it_is_up(make_pool):
    """A review: start() made the pool visible before the groups were up, a stream routed to a
    "starting" replica was booked but never handed over, timed out, and its cancel (for an id no
    leader had) kept the id and its row taken for good. (With real Ray: test_stream_during_start.py.)"""
    gate = threading.Event()

    class StartsWhenOpened(Factory):
        def __call__(self, index, restart):
            assert gate.wait(TIMEOUT_S), "the test never let the group start"
            started = super().__call__(index, restart)
            started.group.serving = True  # a continuous-batching group: streams are handed to its leader
            started.group.poll = lambda wait_s: (time.sleep(wait_s), ([], {}, {}))[1]
            return started

    pool = make_pool(1, StartsWhenOpened())
    starter = threading.Thread(target=pool.start, daemon=True)
    starter.start()
    replica = pool.replicas[0]
    assert replica.state == "starting"
    early, dropped = stream_handle("early"), stream_handle("dropped")
    pool.submit_streams([early], rows=2)
    pool.submit_streams([dropped], rows=2)
    pool.cancel_stream(dropped)  # its reader gave up before any group had it
    assert replica.cancelling == set() and replica.rows_taken() == 1  # no leader will answer: nothing owed
    gate.set()
    starter.join(TIMEOUT_S)
    assert replica.state == "serving" and [r.request_id for r in factory_seen(pool, 0)] == ["early"]
    assert early.attempts == 1
    pool.cancel_stream(early)  # handed over: its cancel waits for the leader's answer
    assert replica.cancelling == {"early"} and replica.started.group.cancelled == [["early"]]


def test_a_cancel_for_an_id_its_group_never_had_leaves_nothing_owed(make_pool):
    """Defence in depth: only a leader that had the id answers its cancel, so only such an id may
    wait in `cancelling` (one that never got an answer held its row and its id for good)."""
    pool = make_pool(1)
    pool.start()
    replica = pool.replicas[0]
    handle = stream_handle("x")
    with replica._streams_lock:  # booked but never handed over, as a stream sent during the start was
        replica.streams["x"], handle.replica = handle, 0
    pool.cancel_stream(handle)
    assert replica.cancelling == set() and replica.rows_taken() == 0 and replica.started.group.cancelled == []
    pool.submit_stream(stream_handle("x"))  # the id is free at once
    assert [r.request_id for r in factory_seen(pool, 0)] == ["x"]
