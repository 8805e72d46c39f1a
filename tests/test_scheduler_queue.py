"""The scheduler's queue of waiting requests (workers/serving/scheduler.py) at scale.

With 16,000 requests queued at once the leader's loop stalled for 21 s, running streams with it:
each add scanned the whole queue for its id, and each cancel compared the sequence field by field
(the whole request) with every one ahead of it; and once compared by identity, a cancel still
walked the queue up to the request. Time depends on the machine, so these tests count comparisons
instead: adding N and cancelling K takes O(N + K) id comparisons, and no sequence comparisons.
"""

from __future__ import annotations

import pytest

from tests.serving_driver import request
from workers.serving.scheduler import Scheduler, Sequence

QUEUED = 1000
CANCELLED = 100


class CountedId(str):
    """A request id that counts how often it is compared for equality (a dict lookup that finds an
    equal hash compares once; a scan of the queue compares with each request in it)."""

    comparisons = 0

    def __eq__(self, other):
        CountedId.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


class CountedSequence(Sequence):
    """A sequence that counts how often it is compared (a walk of a queue compares it with each one
    it passes; a lookup by id never compares sequences)."""

    comparisons = 0

    def __eq__(self, other):
        CountedSequence.comparisons += 1
        return self is other

    __hash__ = object.__hash__


def comparisons_during(action):
    """The id comparisons `action()` makes, and what it returned."""
    CountedId.comparisons = 0
    result = action()
    return CountedId.comparisons, result


def queued(sched: Scheduler, count: int) -> list[Sequence]:
    sequences = [Sequence(request(CountedId(f"r{i}"), (1, 2), 1)) for i in range(count)]
    for seq in sequences:
        sched.add(seq)
    return sequences


def test_queuing_and_cancelling_compare_ids_a_number_of_times_linear_in_the_requests():
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=8, max_chunk=8)
    added, sequences = comparisons_during(lambda: queued(sched, QUEUED))
    assert added <= QUEUED, f"{QUEUED} adds compared ids {added} times"
    newest = sequences[:-CANCELLED - 1:-1]
    # a fresh id object, as a cancel from the driver brings: equal, never the queued one itself
    cancelled, gone = comparisons_during(lambda: [sched.cancel(CountedId(s.request.request_id)) for s in newest])
    # a dict's pop compares the found key a few times (OrderedDict: its links too), never the queue's
    assert cancelled <= 3 * CANCELLED, f"{CANCELLED} cancels compared ids {cancelled} times"
    assert all(got is seq for got, seq in zip(gone, newest))
    assert list(sched.waiting) == sequences[:-CANCELLED]
    assert sched.load() == {"running": 0, "waiting": QUEUED - CANCELLED}


def test_a_duplicate_or_absent_id_is_found_without_scanning_the_queue():
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=8, max_chunk=8)
    queued(sched, QUEUED)
    last = CountedId(f"r{QUEUED - 1}")

    def add_duplicate():
        with pytest.raises(ValueError, match=f"request id '{last}' is already queued or running"):
            sched.add(Sequence(request(CountedId(last), (3,), 1)))

    assert comparisons_during(add_duplicate)[0] <= 2
    first_cancel, seq = comparisons_during(lambda: sched.cancel(CountedId(last)))
    second_cancel, again = comparisons_during(lambda: sched.cancel(CountedId(last)))
    assert seq.request.request_id == last and again is None
    assert first_cancel <= 3 and second_cancel <= 3, (first_cancel, second_cancel)
    sched.add(Sequence(request(CountedId(last), (3,), 1)))  # its id is free again once cancelled


def test_a_seated_request_leaves_the_queue_and_is_cancelled_once():
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=8, max_chunk=8)
    sequences = queued(sched, QUEUED)
    sched.schedule()
    assert list(sched.running) == ["r0", "r1"] and len(sched.waiting) == QUEUED - 2
    with pytest.raises(ValueError, match="request id 'r0' is already queued or running"):
        sched.add(Sequence(request(CountedId("r0"), (3,), 1)))
    assert sched.cancel(CountedId("r0")) is sequences[0] and [c.row for c in sched.rows_to_clear] == [0]
    # no longer running nor waiting: found absent without a scan of the queue behind it
    again, none = comparisons_during(lambda: sched.cancel(CountedId("r0")))
    assert none is None and again <= 2, f"cancelling a gone request compared ids {again} times"
    assert len(sched.waiting) == QUEUED - 2


def test_a_request_held_back_for_a_prefix_stays_queued_and_cancellable():
    """B waits for A's prefill of their shared prefix (prefix caching): put back first in line, its id
    is still taken and a cancel finds it; so does one for the newest request, queued behind it."""
    shared = tuple(range(100, 164))
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=16, max_chunk=16, prefix_caching=True)
    sched.add(Sequence(request(CountedId("A"), shared + (1,), 4)))
    held = Sequence(request(CountedId("B"), shared + (2,), 4))
    sched.add(held)
    newest = queued(sched, QUEUED)[-1]
    sched.schedule()
    assert list(sched.running) == ["A"] and next(iter(sched.waiting)) is held
    with pytest.raises(ValueError, match="request id 'B' is already queued or running"):
        sched.add(Sequence(request(CountedId("B"), (3,), 1)))
    count, got = comparisons_during(lambda: (sched.cancel(CountedId(newest.request.request_id)),
                                             sched.cancel(CountedId("B"))))
    assert got == (newest, held) and held not in sched.waiting and newest not in sched.waiting
    assert count <= 6, f"two cancels compared ids {count} times"


def test_a_sequence_is_equal_only_to_itself():
    """Two sequences of equal fields are two requests' states: the queue tells them apart (a
    field-by-field __eq__ made a twin 'in' the queue and let deque.remove take either)."""
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=8, max_chunk=8)
    same = request("same", (1, 2), 1)
    queued_one, twin = Sequence(same), Sequence(same)
    sched.add(queued_one)
    assert queued_one == queued_one and queued_one != twin
    assert queued_one in sched.waiting and twin not in sched.waiting
    assert sched.cancel("same") is queued_one and not sched.waiting


def test_cancelling_the_newest_requests_walks_no_queue():
    """The newest of N queued requests, cancelled first (a client dropping a large call): found by
    id, each was still removed by a walk of the queue from its front, N comparisons a cancel."""
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=8, max_chunk=8)
    sequences = [CountedSequence(request(f"r{i}", (1, 2), 1)) for i in range(QUEUED)]
    for seq in sequences:
        sched.add(seq)
    CountedSequence.comparisons = 0
    gone = [sched.cancel(f"r{i}") for i in range(QUEUED - 1, QUEUED - 1 - CANCELLED, -1)]
    compared, CountedSequence.comparisons = CountedSequence.comparisons, 0
    assert compared == 0, f"{CANCELLED} cancels compared sequences {compared} times"
    assert all(got is seq for got, seq in zip(gone, sequences[:-CANCELLED - 1:-1], strict=True))
    assert list(sched.waiting) == sequences[:-CANCELLED]
