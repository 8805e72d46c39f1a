"""Rank 0's rendezvous port (workers/rank_worker.py RankWorker.rendezvous_port): rank 0 picks it, the
driver hands it to every rank, and rank 0's store serves it in init_backend. It came from the OS's
ephemeral range (free_port), where any outbound connection's automatic bind (Ray makes many) could
take it meanwhile, and the group failed to start with "Address already in use"; then it was picked
below that range but only probed, so an explicit bind could still take it before the store; now
rank 0 listens on it from the moment it is chosen and its store takes that socket over."""

from __future__ import annotations

import errno
import socket
import threading
from pathlib import Path

import pytest

from workers.backends.base import RendezvousInfo, rendezvous_store
from workers.rank_worker import RankWorker, WorkerSpec

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def join_two(port: int, listener: socket.socket | None):
    """Rank 0's store (on `listener` when given) and rank 1's, joined through 127.0.0.1:port."""
    stores: dict = {}

    def rank_0() -> None:  # its store waits for rank 1 to connect
        try:
            stores[0] = rendezvous_store(RendezvousInfo("127.0.0.1", port, listener), 0, 2, 30.0)
        except BaseException as err:  # noqa: BLE001 - reported below
            stores[0] = err

    leader = threading.Thread(target=rank_0, daemon=True)
    leader.start()
    follower = rendezvous_store(RendezvousInfo("127.0.0.1", port), 1, 2, 30.0)
    leader.join(30)
    assert not isinstance(stores.get(0), BaseException), stores
    return stores[0], follower


@pytest.mark.skipif(not EPHEMERAL_RANGE.exists(), reason="no Linux ephemeral port range to stay out of")
def test_rank_0_picks_a_rendezvous_port_outside_the_ephemeral_range_and_holds_it_for_its_store():
    low, high = map(int, EPHEMERAL_RANGE.read_text().split())
    worker = RankWorker(WorkerSpec(rank=0, world_size=2, backend="cpu", threads=1))
    ports = [worker.rendezvous_port("127.0.0.1") for _ in range(5)]
    assert not any(low <= port <= high for port in ports), f"{ports} within the ephemeral range {low}-{high}"
    port = ports[-1]
    # held from its choice on: another bind of it fails (with the probe alone, this one took it)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        with pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
    # the earlier choices were let go (one port held at a time)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", ports[0]))

    # The port as init_backend uses it: rank 0's store takes the held socket, rank 1 joins through it.
    listener, worker._rendezvous_listener = worker._rendezvous_listener, None
    leader, follower = join_two(port, listener)
    leader.set("from rank 0", "hello")
    assert follower.get("from rank 0") == b"hello"


def test_a_store_that_fails_raises_its_own_error_frees_the_port_and_a_released_rank_lets_its_port_go():
    from torch.distributed import DistStoreError

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # the store's own error (it closed the descriptor it took: closing it again here raised EBADF instead)
    with pytest.raises(DistStoreError):
        rendezvous_store(RendezvousInfo("127.0.0.1", port, listener), 0, 2, 0.5)
    assert listener.fileno() == -1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", port))

    worker = RankWorker(WorkerSpec(rank=0, world_size=2, backend="cpu", threads=1))
    held = worker.rendezvous_port("127.0.0.1")
    worker.shutdown()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", held))
