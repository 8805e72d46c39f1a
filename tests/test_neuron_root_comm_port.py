"""The Neuron root communicator's port (workers/backends/neuron.py shared_root_comm_id): rank 0
picks it, and the runtime binds it only seconds later, once the SDK is imported and the group
joined. It came from the OS's ephemeral range (free_port), where any outbound connection's
automatic bind can take it meanwhile; it is now picked below that range
(workers/net.py free_port_for_a_late_bind). No Neuron package is imported."""

from __future__ import annotations

from workers.backends.neuron import shared_root_comm_id
from workers.net import _LATE_BIND_PORTS


class DictStore:
    """TCPStore's set/get, in memory."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode()

    def get(self, key):
        return self.values[key]


def test_rank_0_picks_a_root_communicator_port_below_the_ephemeral_range():
    store = DictStore()
    address = shared_root_comm_id(store, 0, "10.0.0.5")
    host, port = address.rsplit(":", 1)
    low, high = _LATE_BIND_PORTS
    assert host == "10.0.0.5" and low <= int(port) < high, address
    assert shared_root_comm_id(store, 1, "10.0.0.5") == address  # every rank reads rank 0's choice


def test_an_ipv6_host_is_written_in_brackets():
    address = shared_root_comm_id(DictStore(), 0, "fd00::5")
    assert address.startswith("[fd00::5]:") and int(address.rsplit(":", 1)[1]) > 0, address
