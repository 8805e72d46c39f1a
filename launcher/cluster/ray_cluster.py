"""Connecting to Ray: join a running cluster when there is one, else start a local one.

Only a cluster this module started is shut down by it; a cluster the user runs, or a Ray session
the calling program already opened, is left as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class RayConnection:
    started_here: bool
    """True when corelaunch started this Ray instance (and so must shut it down)."""
    address: str

    def close(self) -> None:
        import ray

        if self.started_here and ray.is_initialized():
            ray.shutdown()


def on_this_host(address: str | None) -> bool:
    """True when connect(address) reaches a cluster on this machine: a private local one, or one
    started here with `ray start --head` (no --ray-address and no RAY_ADDRESS)."""
    return address == "local" or (address is None and not os.environ.get("RAY_ADDRESS"))


def connect(address: str | None = None, num_cpus: int | None = None, worker_logs: bool = False) -> RayConnection:
    """`address`: None (a running cluster if any, else local), "auto", "local", or "host:port".

    worker_logs: print the workers' output in this process (Ray's log_to_driver: their stderr on
    stderr, their stdout on stdout, each line prefixed with the actor and its pid; the rank actors
    write nothing on stdout, see ray_worker.py). Only for a connection made here: a Ray session the
    calling program opened keeps its own setting."""
    import ray

    quiet = dict(log_to_driver=worker_logs, logging_level="ERROR")
    if ray.is_initialized():
        return RayConnection(started_here=False, address="existing session")
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address not in (None, "local"):
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as err:
            raise ConnectionError(
                f"no Ray cluster answered at address={address!r} ({err}); start one with `ray start "
                f"--head`, pass the right --ray-address, or omit it to run a local Ray instance"
            ) from None
        return RayConnection(started_here=False, address=address)
    if address is None:
        try:  # a cluster started on this machine with `ray start --head`
            ray.init(address="auto", **quiet)
            return RayConnection(started_here=False, address="auto")
        except ConnectionError:
            pass
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **quiet)
    return RayConnection(started_here=True, address="local")
