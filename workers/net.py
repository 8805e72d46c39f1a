"""This host's network, as a rank needs it: free TCP ports (for process-group rendezvous, and for
tests and benchmarks that start servers), and the interface traffic to another node leaves by."""

from __future__ import annotations

import ipaddress
import socket


def address_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal ("::1", "fe80::1%eth0"; a node's address may be one), else
    AF_INET (an IPv4 address, a name, "" for every interface): an AF_INET socket refuses an IPv6
    address ("Address family for hostname not supported")."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:  # a name, or ""
        return socket.AF_INET


def host_and_port(host: str, port: int) -> str:
    """host:port as a user pastes it, an IPv6 address in brackets ([fd00::2]:29500): bare, the
    port reads as part of the address."""
    return f"[{host}]:{port}" if address_family(host) == socket.AF_INET6 and not host.startswith("[") else f"{host}:{port}"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` now ("" checks every IPv4 interface). The OS picks
    them; all are held until the last is picked, so they differ. Free now, not reserved: bind them soon."""
    socks = [socket.socket(address_family(host), socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on `host` now (see free_ports)."""
    return free_ports(1, host)[0]


_LATE_BIND_PORTS = (20000, 30000)
"""Where free_port_for_a_late_bind looks: below Linux's default ephemeral range (32768 and up) and
Serve's direct-ingress ranges (30000-31000, 40000-41000), above Ray's fixed ports (6379, 8265, 10001)."""


def _below_the_ephemeral_range() -> list[int]:
    """Up to 200 ports of _LATE_BIND_PORTS below this host's ephemeral range, in random order."""
    import random

    low, high = _LATE_BIND_PORTS
    try:
        ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: its default range starts at 49152
        ephemeral_low = 49152
    candidates = list(range(low, min(high, ephemeral_low)))
    random.shuffle(candidates)
    return candidates[:200]


def free_port_for_a_late_bind(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a server that binds it only seconds later (a Serve
    replica, after Ray and the model have started). One from the OS's ephemeral range can be taken
    meanwhile by any outbound connection's automatic bind, or by a port-0 listener; one below that
    range only by an explicit bind. Falls back to free_port() where none below is free."""
    for port in _below_the_ephemeral_range():
        with socket.socket(address_family(host), socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def listener_below_the_ephemeral_range(host: str, backlog: int) -> socket.socket:
    """A TCP socket listening on `host` at a port below the ephemeral range (as
    free_port_for_a_late_bind picks), held from now on: nothing else can bind that port before
    its owner uses it. The OS's choice where none below is free."""
    for port in _below_the_ephemeral_range():
        try:
            return socket.create_server((host, port), family=address_family(host), backlog=backlog)
        except OSError:
            continue
    return socket.create_server((host, 0), family=address_family(host), backlog=backlog)


def address_toward(host: str) -> str:
    """This host's address that traffic to `host` leaves from, of host's family (127.0.0.1 for an
    IPv4 loopback host, ::1 for the IPv6 one). Nothing is sent: connecting a UDP socket only looks
    up the route. OSError where there is no route (or host names no address of its family)."""
    host = host.strip("[]")
    with socket.socket(address_family(host), socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return sock.getsockname()[0]


def _plain_ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`address` as an IP address without brackets or %scope (so "::1", "[::1]" and
    "0:0::1" compare equal), or None where it is no IP address."""
    try:
        return ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def interface_addresses() -> dict[str, str]:
    """This host's network interfaces that have an IPv4 address, by name: their first (primary)
    IPv4 address."""
    import psutil  # a dependency of ray[default], which every rank runs under

    addresses = {}
    for name, entries in psutil.net_if_addrs().items():
        first = next((entry.address for entry in entries if entry.family == socket.AF_INET), None)
        if first is not None:
            addresses[name] = first
    return addresses


def interface_with_address(address: str) -> str | None:
    """The name of this host's network interface that owns `address`, or None: for IPv4, the
    interface whose first address it is (a labelled alias, eth0:1, is an interface of its own
    name; given an interface, gloo listens on its first address, so a secondary address added
    without a label, which would put gloo on the first one, maybe on another network, gives None);
    for IPv6, any of an interface's addresses (global and link-local ones come in no set order)."""
    import psutil  # a dependency of ray[default], which every rank runs under

    wanted = _plain_ip(address)
    if wanted is None:
        return None
    if wanted.version == 4:
        return next((name for name, own in interface_addresses().items() if _plain_ip(own) == wanted), None)
    for name, entries in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET6 and _plain_ip(entry.address) == wanted for entry in entries):
            return name
    return None


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1): a group meeting there has every rank on one node."""
    ip = _plain_ip(host)
    return ip is not None and ip.is_loopback
