"""A request past its timeout for a cause other than its length is told that cause: one that waited
the whole time for a sequence slot, or one whose group's restart outlasted its time, was told to ask
for fewer tokens (`max_tokens`), and the second not to retry (`x-should-retry: false`), where a retry
(later, or at once on the restarted group) would have served it."""

from __future__ import annotations

import time

import pytest

from launcher.errors import RequestTimeout


def test_a_request_that_never_got_a_slot_is_told_it_waited_for_one(tmp_path, in_process_cluster):
    """Over a real in-process Launcher, one slot: the first request holds it (the default timeout),
    the second, given a short one, waits behind it and times out; then one that held the slot
    times out too and is told as before."""
    from launcher.api import Launcher
    from launcher.serving.openai_app import _generation_failed
    from tests.model_factory import random_model_with_smollm2_tokenizer

    model_dir = random_model_with_smollm2_tokenizer(tmp_path)
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, compile=False) as llm:
        holder = llm.stream("a", max_new_tokens=300, ignore_eos=True)  # seconds: the other waits 0.3
        next(holder)
        started = time.monotonic()
        llm.config.request_timeout_s = 0.3  # the requests submitted from here on
        with pytest.raises(RequestTimeout) as queued:
            list(llm.stream("b", max_new_tokens=4))
        waited_s = time.monotonic() - started
        holder_done = sum(1 for _ in holder)  # it runs on: the other's timeout did not touch it
        with pytest.raises(RequestTimeout) as running:
            list(llm.stream("c", max_new_tokens=480, ignore_eos=True))
    assert holder_done > 0, waited_s
    assert queued.value.waited_for_a_slot, (str(queued.value), waited_s)
    assert "waited all that time for a sequence slot" in str(queued.value)
    assert "max_num_seqs (--max-num-seqs)" in str(queued.value)
    assert not running.value.waited_for_a_slot and "(it had delivered " in str(running.value)
    # over HTTP, as the server tells each error: the 504 says it waited, not "ask for fewer tokens"
    status, body, _ = _generation_failed(queued.value, "chatcmpl-1", [0], [None])
    message = body["error"]["message"]
    assert status == 504 and body["error"]["code"] == "generation_timeout"
    assert message == ("response chatcmpl-1 did not finish within the request timeout (0.3 s): it waited all that "
                       "time for a sequence slot, every one busy with other requests; retry it later, or have the "
                       "server's operator raise its --max-num-seqs or --request-timeout")
    # with several choices one choice's wait speaks for none of the others: told as before
    status, body, _ = _generation_failed(queued.value, "chatcmpl-1", [0, 3], [None, None])
    assert status == 504 and "ask for fewer tokens with max_tokens" in body["error"]["message"]
    status, body, _ = _generation_failed(running.value, "chatcmpl-2", [5], [None])
    assert status == 504 and "ask for fewer tokens with max_tokens" in body["error"]["message"]


def test_only_a_request_behind_a_full_set_of_plain_ones_surely_waits_for_a_slot():
    """The leader seats requests in the books' order, but one with structured output may wait for its
    grammar outside its queue while a later one takes the row: that one, flagged as waiting, was
    told to raise --max-num-seqs though it held the only slot."""
    from types import SimpleNamespace

    from launcher.cluster.replica_pool import Replica

    def held(structured):
        return SimpleNamespace(request=SimpleNamespace(sampling=SimpleNamespace(structured_output=structured)))

    books = {"s": held({"type": "json_object"}), "p": held(None), "q": held(None), "r": held(None)}
    replica = SimpleNamespace(streams=books, pool=SimpleNamespace(rows=1))
    assert Replica._surely_queued(replica) == {"q", "r"}  # p may hold the row while s builds its grammar
    replica.pool.rows = 2
    assert Replica._surely_queued(replica) == {"r"}


def test_a_restarting_replica_with_empty_books_is_no_idle_pool():
    """A full queue's Retry-After leaves idle time out (FinishRate.became_busy); a restart, or a
    leader still owing cancels, with nothing in the books is a stall, which was told as a short wait."""
    from types import SimpleNamespace

    from launcher.cluster.replica_pool import ReplicaPool

    def replica(state="serving", rows_taken=0):
        return SimpleNamespace(state=state, rows_taken=lambda: rows_taken)

    assert ReplicaPool._idle(SimpleNamespace(replicas=[replica(), replica(state="failed")]))
    assert not ReplicaPool._idle(SimpleNamespace(replicas=[replica(), replica(state="restarting")]))
    assert not ReplicaPool._idle(SimpleNamespace(replicas=[replica(state="starting")]))
    assert not ReplicaPool._idle(SimpleNamespace(replicas=[replica(rows_taken=1)]))  # an owed cancel holds a row


def _slow_restarts(llm, seconds: float) -> None:
    """Each new group of the launcher's takes `seconds` longer to start: a staged restart."""
    make = llm._pool._make_group

    def slow_make(*args, **kwargs):
        time.sleep(seconds)
        return make(*args, **kwargs)

    llm._pool._make_group = slow_make


def _lost_to_a_restart(tmp_path, monkeypatch, restart_s: float, served_after: bool = False):
    """A request (2.5 s to finish) whose one-rank group fails two tokens in and restarts in
    restart_s: its RequestTimeout, and with served_after the tokens of a request sent after it."""
    from launcher.api import Launcher
    from launcher.errors import WorkerDied
    from tests.in_process_cluster import TokenGate
    from tests.model_factory import random_model_with_smollm2_tokenizer

    model_dir = random_model_with_smollm2_tokenizer(tmp_path)
    gate = TokenGate(monkeypatch, after=2)  # the request is still running when the fault is set
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, compile=False,
                  request_timeout_s=2.5) as llm:
        _slow_restarts(llm, restart_s)
        stream = llm.stream("a", max_new_tokens=100, ignore_eos=True)
        next(stream)
        llm._group.fail_next(WorkerDied("rank 0 (in-process) died while serving"))
        gate.release()
        with pytest.raises(RequestTimeout) as lost:
            for _ in stream:
                pass
        after = llm.generate(["b"], max_new_tokens=2)[0].token_ids if served_after else None
    return lost.value, after


def test_a_request_its_groups_restart_outlasted_is_told_to_retry(tmp_path, in_process_cluster, monkeypatch):
    """Over a real in-process Launcher: the group fails mid-request and its restart (staged at 5 s)
    outlasts the request's 2.5 s; the request is not resumed, and is told why and to retry, its 504
    letting the client do so."""
    from launcher.serving.openai_app import _generation_failed

    lost, served_after = _lost_to_a_restart(tmp_path, monkeypatch, 5.0, served_after=True)
    assert lost.lost_to_a_restart and not lost.waited_for_a_slot, str(lost)
    assert "its group failed and it was not resumed, its group's restart having outlasted that time; retry it" in \
        str(lost)
    assert len(served_after) == 2  # a retry: the restarted group serves it
    status, body, headers = _generation_failed(lost, "chatcmpl-3", [2], [None])
    assert (status, body["error"]["code"], headers) == (504, "generation_timeout", {})  # no x-should-retry: false
    assert body["error"]["message"] == ("response chatcmpl-3 did not finish within the request timeout (2.5 s); it "
                                        "had delivered 2 tokens: its model failed meanwhile, and restarting it "
                                        "outlasted the request's time; retry it")


def test_a_reader_that_stops_waiting_during_a_long_restart_is_told_to_retry(tmp_path, in_process_cluster,
                                                                             monkeypatch):
    """A real model's reload outlasts the reader's grace past the deadline (30 s; here 0.5 s): the
    reader gave up first, with its own timeout, told as "ask for fewer tokens" and not to retry."""
    from launcher.serving import request_streams
    from launcher.serving.openai_app import _generation_failed

    monkeypatch.setattr(request_streams, "_GRACE_S", 0.5)
    lost, _ = _lost_to_a_restart(tmp_path, monkeypatch, 8.0)  # past the deadline and the grace
    assert lost.lost_to_a_restart, str(lost)
    assert "its group failed and is still restarting; retry it once the replica serves again" in str(lost)
    status, body, headers = _generation_failed(lost, "chatcmpl-4", [2], [None])
    assert (status, headers) == (504, {}) and body["error"]["message"].endswith(
        "restarting it outlasted the request's time; retry it")


def test_a_fault_found_on_an_idle_pool_leaves_the_idle_time_out_of_retry_after(tmp_path, in_process_cluster):
    """The health check finds a dead rank on an idle pool: the restart is the pool's work from then
    on, so the time it stood idle before is no stall (a full queue during the restart said 60 s)."""
    from launcher.api import Launcher
    from launcher.cluster.finish_rate import FinishRate
    from launcher.errors import QueueFull
    from tests.manual_clock import ManualClock
    from tests.model_factory import random_model_with_smollm2_tokenizer

    model_dir = random_model_with_smollm2_tokenizer(tmp_path)
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, max_queued_requests=0, progress=False,
                  compile=False) as llm:
        llm.generate(["a"], max_new_tokens=2)
        clock = ManualClock(1000.0)
        llm._pool.finish_rate = FinishRate(clock)
        busy = llm.stream("c", max_new_tokens=400, ignore_eos=True)  # the pool busy till it closes
        next(busy)
        for _ in range(3):  # three requests end beside it, 5 s apart on the clock
            clock.now += 5
            llm.generate(["b"], max_new_tokens=2)
        busy.close()  # a fourth end
        replica = llm._pool.replicas[0]
        deadline = time.monotonic() + 30
        while not llm._pool._idle():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        clock.now += 300  # idle
        _slow_restarts(llm, 5.0)
        llm._group.kill_rank(0)
        while replica.state != "restarting":
            assert time.monotonic() < deadline + 30, replica.state
            time.sleep(0.05)
        waiting = [llm.stream(p, max_new_tokens=2) for p in ("d", "f")]  # booked there: both rows taken
        with pytest.raises(QueueFull) as refused:
            llm.stream("e", max_new_tokens=2)
        for stream in waiting:
            list(stream)
    assert refused.value.retry_after_s == 3  # 15 s over 4 ends, the idle 300 s left out (60 before)
