"""A node whose address is IPv6: rank 0's rendezvous store (workers/backends/base.py), the driver's
event channel (launcher/cluster/event_channel.py) and the free ports picked for them
(workers/net.py) used IPv4 sockets, which refuse an IPv6 address ("Address family for hostname not
supported"). On the loopback ::1; skipped where the machine has none."""

from __future__ import annotations

import socket

import pytest

from launcher.cluster.event_channel import EventChannel
from tests.test_launcher_failures import _ipv6_loopback
from workers.net import _LATE_BIND_PORTS, address_family, free_port_for_a_late_bind, free_ports


needs_ipv6 = pytest.mark.skipif(not (socket.has_ipv6 and _ipv6_loopback()),
                                reason="no IPv6 loopback (::1) on this machine")


@pytest.mark.parametrize("host, family", [
    ("::1", socket.AF_INET6), ("fe80::1%lo", socket.AF_INET6), ("[::1]", socket.AF_INET6),
    ("127.0.0.1", socket.AF_INET), ("", socket.AF_INET), ("localhost", socket.AF_INET),
])
def test_an_ipv6_literal_gets_an_ipv6_socket(host, family):
    assert address_family(host) == family


@needs_ipv6
def test_free_ports_on_an_ipv6_host_are_free_there():
    ports = free_ports(2, "::1")
    assert len(set(ports)) == 2
    for port in ports:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", port))
    low, high = _LATE_BIND_PORTS
    assert low <= free_port_for_a_late_bind("::1") < high


@needs_ipv6
def test_the_event_channel_listens_on_an_ipv6_address():
    channel = EventChannel("::1")
    try:
        assert channel.address[0] == "::1"
        with socket.create_connection(channel.address, timeout=5) as rank0:
            rank0.sendall(channel.token)
            channel.accept(5)  # raises TimeoutError if the token did not arrive
    finally:
        channel.close()


@needs_ipv6
def test_rank_0s_rendezvous_store_listens_on_an_ipv6_address():
    pytest.importorskip("torch")
    from workers.backends.base import RendezvousInfo, rendezvous_store

    [port] = free_ports(1, "::1")
    store = rendezvous_store(RendezvousInfo("::1", port), 0, 1, 10)
    store.set("key", "value")
    assert store.get("key") == b"value"
