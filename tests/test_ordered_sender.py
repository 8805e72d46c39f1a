"""The group's call sender (launcher/cluster/ordered_sender.py): calls sent in the order put, from
one thread that is not the caller's, none lost to a failing send or to a close and a later put."""

from __future__ import annotations

import threading
import time

from launcher.cluster.ordered_sender import OrderedSender


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the sender did not send in time"
        time.sleep(0.01)


def test_calls_go_in_order_from_one_thread_of_its_own_and_a_failing_send_stops_none():
    sent, threads = [], set()

    def send(item):
        threads.add(threading.current_thread().name)
        if item == 3:
            raise RuntimeError("an actor handle that cannot take the call")
        sent.append(item)

    sender = OrderedSender(send, name="test-group-calls")
    for item in range(10):
        sender.put(item)
    wait_for(lambda: len(sent) == 9)
    assert sent == [0, 1, 2, 4, 5, 6, 7, 8, 9] and threads == {"test-group-calls"}
    sender.close()


def test_a_put_after_close_is_still_sent():
    """kill() closes the sender; a put after it (a late cancel) would otherwise sit in a queue no
    thread reads. The order holds among the items put after the close."""
    sent = []
    sender = OrderedSender(sent.append, name="test-group-calls")
    sender.put("before")
    sender.close()
    sender.put("after-1")
    sender.put("after-2")
    wait_for(lambda: len(sent) == 3)
    assert sorted(sent) == ["after-1", "after-2", "before"] and sent.index("after-1") < sent.index("after-2")
    sender.close()
