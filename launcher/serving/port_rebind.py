"""Let a replica that replaces another bind --port at once, as servers normally do.

With direct ingress (launcher/serving/ingress.py) the one Serve replica's own HTTP server listens on
--port, and Serve's port range is that port alone. Ray Serve 2.60 binds that socket without
SO_REUSEADDR. A replica that is stopped (its TP group failed for good) leaves the connections it
closed in TIME_WAIT on --port for a minute, and while they last the new replica's bind fails with
EADDRINUSE. Serve then blocks the port for good, and with no other port in the range the server
never comes back: seen here with a SIGKILLed rank and a client polling /health
(tests/test_openai_server.py).

SO_REUSEADDR lets a listening socket bind over TIME_WAIT connections that also had it (every
replica applies this patch, so its accepted connections do); on Linux it does not let two
listeners share the port (that would need SO_REUSEPORT). tests/test_port_rebind.py shows both. Serve offers no setting for it, so the
replica's process gives the socket module Serve's HTTP helper uses a socket class that sets it.
The patch touches only that module's sockets, only in a replica process, and does nothing if a
Serve version lacks the helper or already changed its socket module.
"""

from __future__ import annotations

import socket
import types


class _ReuseAddressSocket(socket.socket):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


def allow_port_rebinding() -> bool:
    """Patch Serve's HTTP helper (ray.serve._private.http_util) in this process; True if patched now
    or before, False where the helper is missing or not as expected."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        return False
    current = getattr(http_util, "socket", None)
    if getattr(current, "socket", None) is _ReuseAddressSocket:
        return True
    if current is not socket or not hasattr(http_util, "start_asgi_http_server"):
        return False
    shim = types.ModuleType("socket")
    shim.__dict__.update(socket.__dict__)
    shim.socket = _ReuseAddressSocket
    http_util.socket = shim
    return True
