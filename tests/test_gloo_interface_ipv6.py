"""gloo's interface for a group whose rank 0 is at an IPv6 address (workers/backends/base.py
_pin_gloo_to_the_route_to). The route toward rank 0 was looked up with an IPv4 socket only, which
refuses an IPv6 address: GLOO_SOCKET_IFNAME was then never set, and gloo listened on the address
the host's name resolves to (127.0.1.1 on Ubuntu, which other nodes cannot reach). On the loopback
::1; skipped where the machine has none."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest

from tests.test_launcher_failures import _ipv6_loopback

needs_ipv6 = pytest.mark.skipif(not (socket.has_ipv6 and _ipv6_loopback()),
                                reason="no IPv6 loopback (::1) on this machine")

JOIN_AT_IPV6 = textwrap.dedent("""
    import os
    from workers.backends.base import RendezvousInfo, join_torch_distributed
    from workers.net import free_port
    join_torch_distributed("gloo", RendezvousInfo("::1", free_port("::1")), 0, 1, 30)
    print(os.environ.get("GLOO_SOCKET_IFNAME"))
""")


@needs_ipv6
def test_a_rank_joining_at_an_ipv6_address_pins_gloo_to_the_interface_toward_it():
    pytest.importorskip("torch")
    from workers.net import interface_with_address

    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    out = subprocess.run([sys.executable, "-c", JOIN_AT_IPV6], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    loopback = interface_with_address("127.0.0.1")  # "lo" on Linux
    assert loopback is not None and out.stdout.strip() == loopback


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "[::1]", "0:0::1"])
def test_the_route_to_an_ipv6_host_leaves_by_an_interface_found_by_its_address(host):
    from workers.net import address_toward, interface_with_address

    assert address_toward(host) == "::1"
    assert interface_with_address(host) == interface_with_address("127.0.0.1") is not None


def test_a_group_across_nodes_with_no_interface_found_warns_naming_the_variable(monkeypatch):
    """Where no interface owns the address the route leaves from (an alias, say), gloo's own choice
    stands: for rank 0 on another node that may be an address no other node reaches, so the rank
    says which variable fixes it. A loopback group (one node) says nothing."""
    import warnings

    import workers.net as net
    from workers.backends.base import _pin_gloo_to_the_route_to

    try:
        net.address_toward("192.0.2.77")  # TEST-NET-1: routed by a default route, if there is one
    except OSError as no_route:
        pytest.skip(f"no route off this host: {no_route}")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(net, "interface_with_address", lambda address: None)
    with pytest.warns(RuntimeWarning, match=r"set GLOO_SOCKET_IFNAME .* \(ip route get 192\.0\.2\.77\)"):
        try:
            _pin_gloo_to_the_route_to("192.0.2.77")
        finally:
            assert "GLOO_SOCKET_IFNAME" not in os.environ
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _pin_gloo_to_the_route_to("127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ


@pytest.mark.parametrize("host, written", [
    ("fd00::2", "[fd00::2]:29500"), ("[fd00::2]", "[fd00::2]:29500"), ("10.0.0.5", "10.0.0.5:29500"),
])
def test_a_rendezvous_address_names_an_ipv6_host_in_brackets(host, written):
    """Named in the rendezvous timeout's message: fd00::2:29500 reads as one IPv6 address."""
    from workers.net import host_and_port

    assert host_and_port(host, 29500) == written


def test_rank_0_at_ipv6_with_gloo_on_the_interfaces_ipv4_warns_naming_both(monkeypatch):
    """Given an interface, gloo listens on its first address, IPv4 where it has one: a cluster whose
    nodes reach each other over IPv6 alone then fails to join, so the rank says which address gloo
    took and which variable changes it (the interface and its addresses stand in for a dual-stack
    node's: this host's own have no IPv6 route off it to test with)."""
    import workers.net as net
    from workers.backends.base import _pin_gloo_to_the_route_to

    # set first, so the variable this test's rank pins is taken away again afterwards (a delenv of an
    # unset variable records nothing to undo: "eth9" stayed in the worker, and later tests' gloo failed)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset-after-the-test")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(net, "address_toward", lambda host: "fd00::5")
    monkeypatch.setattr(net, "interface_with_address", lambda address: "eth9" if address == "fd00::5" else None)
    monkeypatch.setattr(net, "interface_addresses", lambda: {"eth9": "10.9.0.5"})
    with pytest.warns(RuntimeWarning, match=r"rank 0 is at the IPv6 address fd00::99, but gloo listens on eth9's "
                                            r"IPv4 address 10\.9\.0\.5 .* set GLOO_SOCKET_IFNAME"):
        _pin_gloo_to_the_route_to("fd00::99")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
    monkeypatch.setattr(net, "interface_addresses", lambda: {})  # IPv6 alone: gloo listens there, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _pin_gloo_to_the_route_to("fd00::99")
