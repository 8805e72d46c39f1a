"""How HTTP requests reach the Serve replicas of `corelaunch serve`: straight into the one replica,
or through Serve's proxy, which spreads them over several.

Why it matters: on a host whose cores the model's ranks use, every process on the path of a
streamed token takes its CPU from the forward. Through Serve's proxy, each token's server-sent
event is handed from the replica to the proxy as a Ray streaming-generator item and written to the
client by the proxy: over one `benchmarks/serving.py --levels 1,16` run the proxy and the replica
used about 1.8 and 1.9 CPU-s, against 0.45 (the proxy idling) and 1.1 when the replica's own HTTP
server answers the client (README, Measured).

- direct (the default with one Serve replica): Ray Serve's direct ingress
  (RAY_SERVE_ENABLE_DIRECT_INGRESS): the ingress replica runs its own HTTP server, on --host:--port,
  because the port range Serve allocates replica ports from is set to exactly that port. Serve
  still starts its proxy on the head node; it listens on another free port of the same host, which
  no client needs.
- proxy: Serve's proxy listens on --port and routes each request to a replica. Needed for several
  replicas or autoscaling (one port cannot belong to several replica processes).

Serve's controller also ticks ten times a second by default (about 1.1 CPU-s in the same run, 0.4
at one tick a second); a private cluster's controller ticks once a second instead, unless
RAY_SERVE_CONTROL_LOOP_INTERVAL_S is set. Its tick paces replica start-up, health bookkeeping and autoscaling decisions, none of
which needs a tenth of a second here.

No Ray is touched. The settings are environment variables, read by Serve's processes when they
start, so they are set before the private Ray cluster starts (its processes inherit them).

Serve's proxy binds --port with SO_REUSEPORT (Ray Serve 2.60: SERVE_SOCKET_REUSE_PORT_ENABLED,
default "1", read when its proxy module is imported in the proxy actor's process). Another listener
that also sets it, bound after the command's port check and before the proxy (a second server
started at the same moment), shares the port: the kernel hands it part of the connections, and
neither side's bind fails. Turning the option off ("0") would make the proxy's bind fail instead,
but Serve then binds without SO_REUSEADDR too, and the TIME_WAIT connections a stopped server leaves
on --port for a minute would fail every restart on that port. So the option stays, and the
command counts the listeners on --port once the proxy has bound it (listeners_on).
"""

from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "direct", "proxy")

CONTROL_LOOP_INTERVAL_S = "1.0"
"""Serve controller's tick on a private cluster (Serve's own default is 0.1 s)."""


@dataclass(frozen=True)
class IngressPlan:
    mode: str
    """"direct" or "proxy"."""
    port: int
    """Where clients connect (--port)."""
    proxy_port: int
    """Where Serve's proxy listens: --port in proxy mode, another free port in direct mode."""
    environment: dict[str, str]
    """Variables Serve's processes must see when they start."""


class IdleProxyAddressHidden(logging.Filter):
    """Direct ingress: Serve's driver logs that the application "is ready at" its proxy's address,
    a port no client uses, just before corelaunch's own ready line names --port; a user took the
    first for the server's address. Serve's other lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return " is ready at " not in record.getMessage()


def choose_mode(requested: str, most_replicas: int, autoscaling: bool) -> str:
    """"direct" or "proxy" for --ingress `requested`; ValueError naming the fix where direct
    ingress cannot serve the replica count."""
    if requested not in MODES:
        raise ValueError(f"--ingress ({requested!r}) must be one of {', '.join(MODES)}")
    several = most_replicas > 1 or autoscaling
    if requested == "direct" and several:
        may_run = (f"autoscales (--min-replicas, --max-replicas or --target-ongoing-requests)"
                   if autoscaling else f"may run {most_replicas} (--replicas)")
        raise ValueError(f"--ingress direct serves one Serve replica on --port, but this server {may_run}; use "
                         f"--ingress proxy (or auto), or one fixed replica")
    if requested == "auto":
        return "proxy" if several else "direct"
    return requested


def plan_ingress(mode: str, port: int, free_port, inherited: dict[str, str]) -> IngressPlan:
    """The plan for a chosen mode. free_port() -> a free port for the idle proxy (direct mode);
    inherited: the caller's environment (a control-loop interval set there is kept)."""
    environment = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": inherited.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S",
                                                                      CONTROL_LOOP_INTERVAL_S)}
    if mode == "proxy":
        environment["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0"
        return IngressPlan(mode, port, port, environment)
    environment.update({
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # Serve hands replicas ports from [MIN, MAX): exactly --port.
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        # A replica Serve replaces gets the port back at once (Serve otherwise holds a released
        # port out of the pool for minutes, for load balancers that this set-up does not have) ...
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # ... and the replica it replaces (one whose TP groups failed for good) is stopped at once
        # rather than drained for 30 s or more while it holds the port its successor must bind.
        "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1",
        # Serve holds a stopping direct-ingress replica open for at least 30 s so that an external
        # load balancer can deregister it; there is none here, and it made every shutdown take 30 s.
        # In-flight requests are still waited for, up to the deployment's graceful shutdown timeout.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    })
    proxy_port = free_port()
    while proxy_port == port:  # the OS never hands out a port that is bound, but --port is not bound yet
        proxy_port = free_port()
    return IngressPlan(mode, port, proxy_port, environment)


_LISTEN = "0A"
"""TCP_LISTEN, as /proc/net/tcp writes a socket's state."""


def listeners_on(host: str, port: int, table: Path = Path("/proc/net/tcp")) -> int:
    """How many IPv4 sockets of this network namespace listen on `port` at an address that takes
    connections for host (the same address, or either one 0.0.0.0), read from the kernel's table:
    1 where Serve's proxy alone does, more where another listener shares the port with it."""
    wildcard = "0.0.0.0"
    count = 0
    try:
        # a name (localhost, this machine's) as the proxy's bind resolved it: compared as typed, it
        # matched no address and the check never refused
        host = socket.gethostbyname(host) if host else wildcard
        rows = table.read_text().splitlines()[1:]
    except (OSError, UnicodeError):  # no such table (not Linux), or an IPv6-only name: nothing is told
        return 0
    for line in rows:
        fields = line.split()
        local, state = fields[1], fields[3]
        address_hex, port_hex = local.split(":")
        if state != _LISTEN or int(port_hex, 16) != port:
            continue
        # the address is the kernel's 32-bit value printed in hex, in this host's byte order
        address = socket.inet_ntoa(struct.pack("=I", int(address_hex, 16)))
        if wildcard in (host, address) or address == host:
            count += 1
    return count
