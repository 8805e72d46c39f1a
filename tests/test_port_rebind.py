"""launcher/serving/port_rebind.py: Serve's HTTP helper gets sockets that bind over the TIME_WAIT
connections a stopped replica left on the port, checked on real loopback ports."""

from __future__ import annotations

import errno
import socket

import pytest


def _port_left_in_time_wait(make_socket) -> int:
    """A loopback port whose listener (made by make_socket, as a replica's server) accepted a
    connection, closed it first, so the port holds it in TIME_WAIT, and then stopped listening."""
    server = make_socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()
    client.recv(1)  # the server's close has arrived
    client.close()
    server.close()
    return port


def test_a_replaced_replica_binds_the_port_its_predecessor_left_in_time_wait():
    from ray.serve._private import http_util

    from launcher.serving.port_rebind import allow_port_rebinding

    # Without the patch, as Serve 2.60 binds: the successor's bind fails.
    port = _port_left_in_time_wait(socket.socket)
    plain = socket.socket()
    with pytest.raises(OSError) as err:
        plain.bind(("127.0.0.1", port))
    assert err.value.errno == errno.EADDRINUSE
    plain.close()

    # With it, in both replicas (each runs OpenAIServer's constructor): the successor binds.
    assert allow_port_rebinding() and allow_port_rebinding()  # idempotent
    make = http_util.socket.socket
    port = _port_left_in_time_wait(make)
    sock = make(http_util.socket.AF_INET, http_util.socket.SOCK_STREAM)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        sock.bind(("127.0.0.1", port))
        sock.listen()
        second = make(http_util.socket.AF_INET, http_util.socket.SOCK_STREAM)
        with pytest.raises(OSError):  # still one listener per port: SO_REUSEADDR is not SO_REUSEPORT
            second.bind(("127.0.0.1", port))
        second.close()
    finally:
        sock.close()
    assert socket.socket is not make  # the process's own socket module is untouched
