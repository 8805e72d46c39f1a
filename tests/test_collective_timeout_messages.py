"""What a CPU group's collectives say when a peer never arrives (workers/shm).

A review: the timeout advised CORELAUNCH_COLLECTIVES=gloo, which waits just as long, and named
neither the wait nor the setting behind it (a launched group's --rendezvous-timeout plus 5 s).
Across nodes, a rank waiting for its node's leader blamed that healthy leader, while the leader,
stuck in gloo behind another node's rank, raised gloo's own text naming no rank and no setting.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.test_shm_collectives import run_ranks, thread_ranks


def test_a_shared_memory_timeout_names_its_wait_and_the_setting_behind_it(tmp_path):
    from workers.shm.exchange import CollectiveTimeout

    first, second = thread_ranks(tmp_path, 2, timeout_s=1.0)
    try:
        with pytest.raises(CollectiveTimeout) as info:
            first.all_reduce_sum_(torch.ones(8))  # the second rank never calls it
    finally:
        first.close()
        second.close()
    message = str(info.value)
    assert "waited 1 s for rank 1" in message, message
    assert "--rendezvous-timeout plus 5 s" in message and "raise --rendezvous-timeout" in message, message
    # gloo is offered to tell the paths apart, not as a cure: it waits as long
    assert "CORELAUNCH_COLLECTIVES=gloo (it waits as long)" in message, message


# ---- across nodes: a rank of another node never arrives --------------------------------------------
TIMEOUT_S = 3.0


def _rank_2_never_arrives(rank, world_size):
    """Ranks 0 and 1 share "node 0", rank 2 is "node 1" and skips the all-reduce. What each of
    ranks 0 and 1 raised, and after how long."""
    from tests.test_shm_collectives import _build

    coll = _build(rank, world_size, node_groups=[[0, 1], [2]], timeout_s=TIMEOUT_S, slot_bytes=4096)
    if rank == 2:
        time.sleep(3 * TIMEOUT_S)  # alive, but elsewhere: the others' waits end on their timeout
        coll.close()
        return None
    start = time.monotonic()
    return _all_reduce_outcome(coll), time.monotonic() - start


def _all_reduce_outcome(coll) -> str:
    """What an all-reduce raised ("no error" if nothing), the collectives closed after it."""
    try:
        coll.all_reduce_sum_(torch.ones(16))
        outcome = "no error"
    except Exception as err:  # noqa: BLE001 - the message is the finding
        outcome = f"{type(err).__name__}: {err}"
    coll.close()
    return outcome


@pytest.mark.slow
def test_across_nodes_the_timeouts_point_at_the_other_node_not_the_local_leader():
    results = run_ranks(3, _rank_2_never_arrives, timeout_s=120)
    (leader, leader_waited), (follower, follower_waited) = results[0], results[1]
    # the leader, stuck in gloo: names the node leader it waited for and the setting behind the wait
    assert leader.startswith("CollectiveTimeout: node leader rank 0: the gloo all-gather"), leader
    assert "other nodes' leaders (rank 2)" in leader and "raise --rendezvous-timeout" in leader, leader
    # the rank waiting for that leader: the leader was only the messenger of rank 2's node
    assert leader_waited < 3 * TIMEOUT_S and follower_waited < 3 * TIMEOUT_S
    assert follower.startswith(
        "CollectiveTimeout: shared-memory collective on rank 1: waited 3 s for rank 0"), follower
    assert "this node's leader, which itself waits over gloo for the other nodes' leaders (rank 2)" in follower, follower


def _rank_2_exits(rank, world_size):
    """As _rank_2_never_arrives, but rank 2's process exits: gloo's connection closes, no wait runs out."""
    from tests.test_shm_collectives import _build

    coll = _build(rank, world_size, node_groups=[[0, 1], [2]], timeout_s=30.0, slot_bytes=4096)
    if rank == 2:
        time.sleep(1.0)
        os._exit(0)
    return _all_reduce_outcome(coll)


@pytest.mark.slow
def test_a_leader_whose_gloo_peer_exited_says_the_connection_was_lost_not_to_raise_the_timeout():
    """The leader's gloo error was all called a timeout, advising to raise --rendezvous-timeout,
    also where a peer's process had exited (gloo: "Connection closed by peer") a second in."""
    results = run_ranks(3, _rank_2_exits, timeout_s=150, expect=2)
    leader = results[0]
    assert leader.startswith("CollectiveTimeout: node leader rank 0: the gloo all-gather"), leader
    assert "The connection to one of them was lost" in leader and "rank 2" in leader, leader
    assert "raise --rendezvous-timeout" not in leader, leader
