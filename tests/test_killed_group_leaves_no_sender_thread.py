"""A cancel that reaches a group just killed (a reader's cancel_stream that saw the replica
"serving" while its thread restarted the group, or a shutdown's kill) sends nothing and starts no
thread. It started one on the dead group's sender, which waited for ever on an empty queue and kept
the dead TPGroup alive. No Ray: the group is never started (kill() and the sender need none)."""

from __future__ import annotations

import threading
import time
import uuid

from launcher.cluster.ordered_sender import OrderedSender
from launcher.cluster.resources import RankResources
from launcher.cluster.tp_group import TPGroup


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def wait_until_gone(name: str, timeout_s: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout_s
    while threads_named(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads_named(name)


def test_a_cancel_after_kill_leaves_no_thread_behind():
    group = TPGroup(tp_degree=1, backend="cpu", name=f"leak-{uuid.uuid4().hex[:8]}",
                    resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1))
    sender_thread = f"{group.name}-group-calls"
    group.cancel(["before-the-kill"])  # the group's sender thread is running
    assert threads_named(sender_thread)
    group.kill()  # what Replica._restart, _give_up and ReplicaPool.shutdown do to the group
    group.cancel(["late-cancel"])  # a reader's cancel that saw the replica still serving
    group.submit(["late-submit"])
    assert wait_until_gone(sender_thread) == []


def test_a_final_close_drops_later_puts_and_a_plain_close_does_not():
    sent = []
    sender = OrderedSender(sent.append, name=f"final-{uuid.uuid4().hex[:8]}")
    sender.close(final=True)
    sender.put("after the final close")
    time.sleep(0.1)
    assert sent == [] and wait_until_gone(sender._name) == []
    plain = OrderedSender(sent.append, name=f"plain-{uuid.uuid4().hex[:8]}")
    plain.close()  # not final: a later put starts a thread of its own again, and is sent
    plain.put("after a plain close")
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == ["after a plain close"]
    plain.close()
