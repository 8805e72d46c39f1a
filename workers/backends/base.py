"""The interface every device backend implements for one rank.

It imports no torch at module level: the driver imports it (through workers.rank_worker's specs) to
start ranks, and torch there would cost about 2 s of every start-up before Ray could start."""

from __future__ import annotations

import abc
import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from shardlib.buckets import Buckets

if TYPE_CHECKING:
    import torch

    from workers.collectives import Collectives


@dataclass(frozen=True)
class RendezvousInfo:
    """Where the process group meets: rank 0's node address and a port free there."""

    host: str
    port: int
    listener: socket.socket | None = field(default=None, compare=False, repr=False)
    """Rank 0: the socket already listening at host:port since the port was chosen
    (RankWorker.rendezvous_port), which its store takes over; None: the store binds the port."""


@dataclass(frozen=True)
class CompileOptions:
    """How a backend turns a model into its per-bucket graphs (see Backend.prepare_model)."""

    buckets: Buckets
    """The shapes to build graphs for: one per (phase, batch bucket, length bucket)."""
    cache_dir: str | None = None
    """Where compiled artifacts are persisted and looked up (a compiled-model directory's cache);
    None: the backend's default location."""
    granularity: str | None = None
    """What one compiled graph covers where the backend offers a choice (workers/granularities.py,
    its registry entry's granularities); None: the backend's default."""
    warm_up: bool = False
    """Build every bucket's graph now; otherwise each is built the first time a request needs it."""
    progress: Callable[[int, int, tuple[str, int, int], float], None] | None = None
    """Called after each graph built by warm_up with (done, total, (phase, batch, length), seconds)."""
    announce: Callable[[str], None] | None = None
    """Where a line about each graph built during a request goes; None: the backend's default
    (stderr). The ranks of a group build the same graphs together, so only rank 0 announces."""


def join_torch_distributed(process_group_backend: str, rendezvous: RendezvousInfo, rank: int, world_size: int,
                           timeout_s: float, **options) -> None:
    """Join torch.distributed's default group at the launcher's rendezvous (rank 0's host:port);
    `options` go to init_process_group.

    Rank 0's store listens on rendezvous.host only (loopback when every rank shares its node), not
    on every interface as a store given a tcp:// address does: it takes a socket rank 0 bound
    itself. The store has no authentication, so it must be reachable by the group's ranks alone.

    gloo's pairs between ranks listen likewise on the interface this rank reaches rendezvous.host
    by (loopback for a group on one node): left to itself, gloo listens on the address the host's
    name resolves to, on most cloud hosts the one every other machine of the network reaches.
    A GLOO_SOCKET_IFNAME set by the user is kept."""
    import torch.distributed as dist

    if "gloo" in process_group_backend and not os.environ.get("GLOO_SOCKET_IFNAME"):
        _pin_gloo_to_the_route_to(rendezvous.host)
    store = rendezvous_store(rendezvous, rank, world_size, timeout_s)
    dist.init_process_group(backend=process_group_backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **options)


def rendezvous_backlog(world_size: int) -> int:
    """How many connections rank 0's store socket queues: every other rank may connect at once."""
    return max(128, world_size)


def rendezvous_store(rendezvous: RendezvousInfo, rank: int, world_size: int, timeout_s: float):
    """The group's TCPStore at the launcher's rendezvous; rank 0's listens on rendezvous.host only
    (see join_torch_distributed), on rendezvous.listener or else a socket it binds itself. The
    store is handed a duplicate of the socket's descriptor and this function closes its own,
    whatever happens: a store that fails has closed the descriptor it took already, so closing
    that number again here hid the store's error behind EBADF and could close whatever another
    thread of the rank had opened under that number meanwhile."""
    import torch.distributed as dist

    from workers.net import address_family

    listener = None
    if rank == 0:
        listener = rendezvous.listener or socket.create_server(
            (rendezvous.host, rendezvous.port), family=address_family(rendezvous.host), backlog=rendezvous_backlog(world_size))
    try:
        return dist.TCPStore(rendezvous.host, rendezvous.port, world_size, rank == 0,
                             timeout=datetime.timedelta(seconds=timeout_s),
                             master_listen_fd=os.dup(listener.fileno()) if listener is not None else None)
    finally:
        if listener is not None:
            listener.close()  # the store's duplicate keeps the socket listening


def _pin_gloo_to_the_route_to(host: str) -> None:
    """Sets GLOO_SOCKET_IFNAME, which gloo reads each time it makes a process group's device, to
    the interface this rank reaches `host` by (IPv4 or IPv6). Given an interface, gloo listens on
    its first address, IPv4 where it has one: rank 0 at an IPv6 address then needs the nodes to
    reach each other over that interface's IPv4 too, or the user's GLOO_SOCKET_IFNAME."""
    from workers.net import address_family, address_toward, interface_addresses, interface_with_address, is_loopback

    try:
        interface = interface_with_address(address_toward(host))
    except OSError:  # no route to rank 0: joining its store fails next, naming the address
        return
    if interface is None:
        if not is_loopback(host):  # a group across nodes: gloo may listen where other nodes cannot reach
            _warn_gloo_left_unpinned(host)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    ipv4 = interface_addresses().get(interface)
    if ipv4 is not None and address_family(host) == socket.AF_INET6 and not is_loopback(host):
        _warn_gloo_on_ipv4(host, interface, ipv4)


def _warn_gloo_on_ipv4(host: str, interface: str, ipv4: str) -> None:
    """Rank 0 is at an IPv6 address, but gloo, given `interface`, listens on its IPv4 address: a
    cluster whose nodes reach each other over IPv6 alone then fails to join."""
    import warnings

    warnings.warn(f"corelaunch: rank 0 is at the IPv6 address {host}, but gloo listens on {interface}'s IPv4 "
                  f"address {ipv4} (its first): the nodes must reach each other over IPv4 there. If the group "
                  f"hangs joining, set GLOO_SOCKET_IFNAME on every node to an interface with IPv6 alone",
                  RuntimeWarning, stacklevel=2)


def _warn_gloo_left_unpinned(host: str) -> None:
    """Once a process (warnings shows a message once per place): no interface was found whose
    address traffic to rank 0 leaves from (a secondary address added without a label, say)."""
    import warnings

    warnings.warn(f"corelaunch: no network interface of this node owns the address it reaches rank 0 at {host} "
                  f"from, so gloo listens on the address this host's name resolves to (127.0.1.1 on some "
                  f"hosts, which other nodes cannot reach). If the group hangs joining, set GLOO_SOCKET_IFNAME "
                  f"to the interface toward the other nodes (ip route get {host.strip('[]')}) on every node",
                  RuntimeWarning, stacklevel=2)


def leave_torch_distributed() -> None:
    """Destroy torch.distributed's default group if this process joined one; safe to call twice."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Backend(abc.ABC):
    """One rank's device: process set-up, its process group, and how models run on it."""

    name: str = "base"
    """The name users pass as --backend (its entry in workers.backends.BACKENDS says the rest)."""

    @abc.abstractmethod
    def setup_process(self, rank: int, world_size: int, threads: int) -> None:
        """Per-process settings, called once before anything heavy (threads, device visibility)."""

    @abc.abstractmethod
    def init_process_group(self, rendezvous: RendezvousInfo, rank: int, world_size: int,
                           timeout_s: float, node_groups: list[list[int]] | None = None) -> Collectives:
        """Join the group of `world_size` ranks; every rank calls this at the same time.

        node_groups: the ranks of each node, e.g. [[0, 1], [2, 3]] for TP 4 over two nodes (the
        launcher knows placement; None means unknown). Ranks sharing a node may use a faster
        co-located path for their collectives; ranks on other nodes go through the network backend.
        """

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def prefetch_compiler(self) -> None:
        """Start importing what prepare_model compiles with, in the background, so the import
        overlaps reading the shard; nothing by default."""

    def prepare_model(self, model: torch.nn.Module, compile: CompileOptions | None = None):
        """The model as this device runs it: eager (compile=None), or through one static-shape graph
        per bucket. The result is called like ShardedCausalLM (see workers.engine.generate) and, when
        compiled, has `buckets` and `stats()`. Eager by default."""
        return model

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the process group; safe to call more than once."""
