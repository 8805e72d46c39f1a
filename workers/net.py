"""Free TCP ports, for process-group rendezvous and for tests and benchmarks that start servers."""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` now ("" checks every interface). The OS picks them;
    all are held until the last is picked, so they differ. Free now, not reserved: bind them soon."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
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
