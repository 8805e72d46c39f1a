"""workers/serving/numbered_calls.py: rank 0 hands the driver's submissions and cancellations to
its serving loop in the order they were sent, though Ray may run a threaded actor's calls in
another order; and the real RankWorker methods go through it."""

from __future__ import annotations

import threading

import pytest

from workers.serving.numbered_calls import NumberedCalls


def test_calls_run_in_their_numbers_order_whatever_order_they_arrive_in():
    calls, ran = NumberedCalls(), []
    calls.run(1, lambda: ran.append("cancel r"))  # arrived first, sent second: held
    assert ran == [] and calls.held == 1
    calls.run(0, lambda: ran.append("submit r"))  # frees it
    assert ran == ["submit r", "cancel r"] and calls.held == 0
    calls.run(3, lambda: ran.append(3))
    calls.run(2, lambda: ran.append(2))
    assert ran[2:] == [2, 3]


def test_an_error_reaches_its_own_sender_and_never_blocks_later_calls():
    calls, ran = NumberedCalls(), []

    def broken():
        raise RuntimeError("this group is not serving")

    calls.run(1, lambda: ran.append(1))
    with pytest.raises(RuntimeError, match="not serving"):
        calls.run(0, broken)
    calls.run(2, lambda: ran.append(2))
    assert ran == [1, 2]
    with pytest.raises(ValueError, match="call number 1 was already given"):
        calls.run(1, lambda: None)


def test_concurrent_senders_in_any_order():
    calls, ran = NumberedCalls(), []
    threads = [threading.Thread(target=calls.run, args=(n, lambda n=n: ran.append(n))) for n in reversed(range(50))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ran == list(range(50))


def test_a_cancel_arriving_before_its_submit_still_cancels_it():
    """The real serving loop behind RankWorker's methods: cancel numbered 1 delivered before submit
    numbered 0. Unordered, the cancel found nothing and the request ran to its last token."""
    from tests.serving_driver import collect, request, run_loops, stop
    from tests.test_engine import PROMPTS, fresh_model
    from workers.rank_worker import RankWorker, WorkerSpec
    from workers.serving.loop import ServingConfig, ServingLoop

    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1))
    loop = ServingLoop(fresh_model(), ServingConfig(2, 64, 64))
    worker._loop = loop
    threads = run_loops([loop])
    worker.cancel_requests(["r"], 1)
    worker.submit_requests([request("r", PROMPTS[0], 40)], 0)
    got = collect(loop, {"r"})
    stop([loop], threads)
    assert got.finish["r"] == "abort"  # not "length": the cancel was applied after its submit
