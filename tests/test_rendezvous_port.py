"""Rank 0's rendezvous port (workers/rank_worker.py RankWorker.rendezvous_port): rank 0 picks it, the
driver hands it to every rank, and rank 0's store binds it only then, in init_backend. It came from
the OS's ephemeral range (free_port), where any outbound connection's automatic bind (Ray makes
many) could take it meanwhile, and the group failed to start with "Address already in use"; it is
now picked below that range (workers/net.py free_port_for_a_late_bind)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from workers.backends.base import RendezvousInfo, rendezvous_store
from workers.rank_worker import RankWorker, WorkerSpec

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL_RANGE.exists(), reason="no Linux ephemeral port range to stay out of")
def test_rank_0_picks_a_rendezvous_port_outside_the_ephemeral_range_that_its_store_binds():
    low, high = map(int, EPHEMERAL_RANGE.read_text().split())
    worker = RankWorker(WorkerSpec(rank=0, world_size=2, backend="cpu", threads=1))
    ports = [worker.rendezvous_port() for _ in range(5)]
    assert not any(low <= port <= high for port in ports), f"{ports} within the ephemeral range {low}-{high}"

    # The port as init_backend uses it: rank 0's store binds it, and rank 1 joins through it.
    stores: dict = {}

    def rank_0() -> None:  # its store waits for rank 1 to connect
        try:
            stores[0] = rendezvous_store(RendezvousInfo("127.0.0.1", ports[0]), 0, 2, 30.0)
        except BaseException as err:  # noqa: BLE001 - reported below
            stores[0] = err

    leader = threading.Thread(target=rank_0, daemon=True)
    leader.start()
    follower = rendezvous_store(RendezvousInfo("127.0.0.1", ports[0]), 1, 2, 30.0)
    leader.join(30)
    assert not isinstance(stores.get(0), BaseException), stores
    stores[0].set("from rank 0", "hello")
    assert follower.get("from rank 0") == b"hello"
