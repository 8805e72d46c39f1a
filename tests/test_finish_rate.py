"""A full queue's Retry-After from how fast requests have left their rows lately
(launcher/cluster/finish_rate.py), and the pool's refusal carrying it."""

from __future__ import annotations

import time

from launcher.cluster.finish_rate import KEPT, LONGEST_WAIT_S, WINDOW_S, FinishRate
from tests.manual_clock import ManualClock


def test_the_wait_is_the_recent_time_between_two_ends():
    clock = ManualClock(1000.0)
    rate = FinishRate(clock)
    assert rate.retry_after_s() == 1  # nothing has ended: nothing to go by
    rate.record()
    assert rate.retry_after_s() == 1  # one end, just now
    for _ in range(9):  # ten ends, one every 3 s
        clock.now += 3
        rate.record()
    assert rate.retry_after_s() == 3  # 27 s up to now over 10 ends, rounded up
    clock.now += 30  # no end since: the pool has slowed, the wait grows to the time since the last end
    assert rate.retry_after_s() == 30
    clock.now += WINDOW_S  # all of them too old now: the time since the last end, at most a minute
    assert rate.retry_after_s() == 60


def test_fast_ends_say_one_second_and_a_slow_or_stalled_pool_up_to_a_minute():
    clock = ManualClock(1000.0)
    rate = FinishRate(clock)
    for _ in range(KEPT * 2):  # only the last KEPT are kept
        clock.now += 0.01
        rate.record()
    assert rate.retry_after_s() == 1
    slow = FinishRate(clock)
    slow.record()
    clock.now += WINDOW_S - 1
    slow.record()
    clock.now += WINDOW_S - 2  # the first end is out of the window now: one end, 58 s ago
    assert slow.retry_after_s() == 58
    slow.record()
    assert slow.retry_after_s() == 29  # 58 s over 2 ends
    stalled = FinishRate(clock)
    for _ in range(2):
        stalled.record()
    clock.now += WINDOW_S - 0.5  # two ends long ago, none since: the 59.5 s since, not 59.5 s over 2 ends
    assert stalled.retry_after_s() == 60 == LONGEST_WAIT_S


def test_a_full_queue_tells_the_wait_its_streams_ending_say(tmp_path, in_process_cluster):
    """Over a real in-process Launcher: the ends its replicas record set QueueFull's retry_after_s
    (ends given a clock of their own here, 5 s apart, so the pace is known), and the time the pool
    then stands idle does not count: it told the first client refused after a minute idle to wait 60 s."""
    import pytest

    from launcher.api import Launcher
    from launcher.errors import QueueFull
    from tests.model_factory import random_model_with_smollm2_tokenizer

    def refused(*holding: str) -> int:
        """QueueFull's retry_after_s for a request once `holding` streams (with any still open) fill the rows."""
        held = [llm.stream(p, max_new_tokens=400, ignore_eos=True) for p in holding]
        for stream in held:
            next(stream)
        with pytest.raises(QueueFull) as refusal:
            llm.stream("e", max_new_tokens=2)
        for stream in held:
            stream.close()
        return refusal.value.retry_after_s

    model_dir = random_model_with_smollm2_tokenizer(tmp_path)
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, max_queued_requests=0, progress=False,
                  compile=False) as llm:
        llm.generate(["a"], max_new_tokens=2)  # the pool exists once something ran
        clock = ManualClock(1000.0)
        llm._pool.finish_rate = FinishRate(clock)
        busy = llm.stream("c", max_new_tokens=400, ignore_eos=True)  # the pool stays busy till it closes
        next(busy)
        for _ in range(3):  # three requests end beside it, 5 s apart on the clock
            clock.now += 5
            llm.generate(["b"], max_new_tokens=2)
        clock.now += 5
        busy_pace = refused("d")  # c and d fill both rows; then both end at once
        busy.close()
        deadline = time.monotonic() + 30  # the leader answers the closed streams' cancels
        while not llm._pool._idle():
            assert time.monotonic() < deadline, [r.cancelling for r in llm._pool.replicas]
            time.sleep(0.05)
        clock.now += 300  # nothing in flight for five minutes
        after_idle = refused("d", "f")
    assert busy_pace == 5  # 15 s up to now over 3 ends
    assert after_idle == 3  # 15 s over its 5 ends, the 300 s idle left out (told as 60 s before)


def test_time_with_nothing_in_flight_is_no_stall():
    clock = ManualClock(1000.0)
    rate = FinishRate(clock)
    for _ in range(4):  # an end every 2 s
        clock.now += 2
        rate.record()
    clock.now += 600  # idle: nothing in flight
    rate.became_busy()
    assert rate.retry_after_s() == 2  # 6 s over the 4 ends (before: 60, the idle time)
    clock.now += 10  # busy, and nothing ends: that stall counts
    assert rate.retry_after_s() == 10
    fresh = FinishRate(clock)
    fresh.became_busy()  # nothing ever ended: nothing to move
    assert fresh.retry_after_s() == 1


def test_a_long_stalled_pool_says_the_longest_wait():
    clock = ManualClock(1000.0)
    rate = FinishRate(clock)
    rate.record()
    clock.now += 600  # one end, ten minutes ago: requests are long, or nothing ends
    assert rate.retry_after_s() == LONGEST_WAIT_S


def test_a_burst_of_ends_then_a_stall_says_the_time_since_the_last_end():
    """A pace faster than the time since the last end is a promise the pool is not keeping: after
    a burst, the window's average said one second for up to a minute of stall, then jumped to 60."""
    clock = ManualClock(1000.0)
    rate = FinishRate(clock)
    for _ in range(KEPT):  # a burst: an end every 10 ms
        clock.now += 0.01
        rate.record()
    assert rate.retry_after_s() == 1
    clock.now += 20  # then nothing ends
    assert rate.retry_after_s() == 20
    clock.now += 20
    assert rate.retry_after_s() == 40
    rate.record()  # ends again: the window's pace once more (about 40.6 s over the 64 kept, rounded up)
    assert rate.retry_after_s() == 1
