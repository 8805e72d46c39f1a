"""One tensor-parallel group on Ray: placement, actors, rendezvous, loading, requests, teardown.

Every wait on Ray here has a deadline and, when it passes, an error naming what did not arrive and
what to change. A rank that dies is reported with its rank and node; the rest of the group is then
killed so no rank stays blocked in a collective. Restarting a broken group is the replica pool's
job (launcher/cluster/replica_pool.py): a TPGroup is started once and thrown away when it breaks.

Placement: one placement group. With nodes=1 the group must fit one node (STRICT_PACK); with more,
one bundle a node holding that node's share of the ranks (resources.node_split: TP / nodes, or ceil
and floor of it where nodes does not divide TP), each on a different node (STRICT_SPREAD). Once Ray
has placed the bundles, ranks are numbered node by node (launcher/cluster/placement.py), rank 0's
node hosts the rendezvous, and every rank is told which ranks share its node (node_groups) so
co-located ranks can use a faster path.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher.errors import (DevicesMissing, LaunchError, PlacementTimeout, RankFailed,
                             RendezvousTimeout, RequestTimeout, WorkerDied, error_chain)
from launcher.cluster.event_channel import ChannelClosed, EventChannel
from launcher.cluster.ordered_sender import OrderedSender
from launcher.cluster.replica_pool import STOPPED_BY_SHUTDOWN
from launcher.cluster.placement import alive_nodes, bundle_nodes, placement_strategy, rank_order
from launcher.cluster.resources import RankResources, actor_options, explain_unplaceable, node_split
from workers.backends import BackendEntry, backend_entry
from workers.net import host_and_port
from workers.rank_worker import GenerateRequest, LoadSpec, LoadStats, ServeSpec, WorkerSpec
from shardlib.planner import divisors, ranks_per_node

# How often a long wait wakes up to check for dead ranks; a death is seen within this delay.
_POLL_S = 0.5
# After one rank raises, how long to look for a rank that died (the usual root cause: the survivors'
# collectives fail because a peer vanished) before reporting the raised error itself.
_ROOT_CAUSE_GRACE_S = 2.0
_RANK_TIMEOUT_MARGIN_S = 5.0
# While serving, how often the driver asks Ray whether a rank's loop has ended (a follower that dies
# is noticed here; rank 0's own end also closes its event stream).
_LOOP_CHECK_S = 0.25

LOAD_STEP = "load its shard"
LOAD_AND_BUILD_STEP = "load its shard and build its graphs"
GRAPH_STEP = "build its graphs"
"""What a rank's load was doing: a load with warm-up (`corelaunch compile`) reads the shard, then
builds every bucket's graphs, the longer part, which a timeout names; a graph builder's error (the
compiler's, or a write of its cache) names GRAPH_STEP, whichever of the two was asked."""


PLACEMENT_RELEASE_WAIT_S = 5.0
"""How long a shutdown waits for Ray to hand back its groups' resources (usually well under a
second): a launch right after it, replicas="auto" above all, then counts the whole cluster."""


def wait_until_released(placement_groups: list, timeout_s: float) -> list:
    """Wait up to timeout_s until Ray has handed back each removed placement group's resources;
    those it has not yet, which the caller need not wait for any longer. Removing a group returns
    at once; its state reads REMOVED first, and only a moment later do its bundles' resources
    (named after its id: CPU_group_<id>) leave their nodes and the CPUs become free again."""
    try:  # per-node availability is not in Ray's public API: without it, REMOVED is all that is known
        from ray._private.state import available_resources_per_node
    except ImportError:
        available_resources_per_node = None
    deadline = time.monotonic() + timeout_s
    pending = list(placement_groups)
    while True:
        # the nodes' resources read once a pass, not once a group
        free = available_resources_per_node() if available_resources_per_node is not None else None
        pending = [pg for pg in pending if not _released(pg, free)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _released(pg, free_per_node: dict | None) -> bool:
    """Whether Ray has removed `pg` and freed its bundles' resources on every node (free_per_node:
    each node's available resources; None where they cannot be read, and REMOVED is then all)."""
    from ray.util.placement_group import placement_group_table

    if placement_group_table(pg).get("state") != "REMOVED":
        return False
    if free_per_node is None:
        return True
    group_id = pg.id.hex()
    return not any(group_id in name for free in free_per_node.values() for name in free)


def placed_by_now(ready: ray.ObjectRef, timeout_s: float) -> bool:
    """Whether the placement group whose ready() is `ready` is placed, waiting up to timeout_s.
    Not the group's own wait(): Ray takes its timeout in whole seconds (0.5 returned at once), and
    wait(timeout_seconds=0) asks the GCS with a deadline of no time, answering False now and then
    for a group placed long before (6 of 50 asks on a quiet machine; a 3 s placement timed out in
    CI with its bundle reserved). ray.wait on ready() takes fractions and sees a placed group."""
    return bool(ray.wait([ready], timeout=max(0.0, timeout_s))[0])


def crowded_node(ranks_on_node: Mapping[str, int], tp: int, nodes: int) -> tuple[str, int] | None:
    """The node holding more ranks than the plan counted (ceil(TP / nodes)) and how many, or None:
    Ray's PACK fills the roomiest node first, TP 3 over 2 nodes all 3 ranks on one node whose RAM
    the plan gave to 2 (groups are now split per node, resources.node_split; this still checks)."""
    if not ranks_on_node:
        return None
    node, count = max(ranks_on_node.items(), key=lambda item: item[1])
    return (node, count) if count > ranks_per_node(tp, nodes) else None


def stopped_by_shutdown(message: str) -> LaunchError:
    """The error of a group stopped because the launcher is shutting down, marked so (its type stays
    a plain LaunchError, which the OpenAI server answers as a stop): a restart cut short this way is
    no failure of its replica, whose requests then fail with the shutdown's own error."""
    err = LaunchError(message)
    setattr(err, STOPPED_BY_SHUTDOWN, True)
    return err


def _refuse_without_ray() -> None:
    """Ray's calls start a new local Ray when none is connected (its auto-init): a group whose
    launcher shut Ray down meanwhile (a restart racing shutdown, still waiting for its ranks past the
    shutdown's grace) must not start one behind its back."""
    if not ray.is_initialized():
        raise stopped_by_shutdown("Ray was shut down while this group was working (the launcher is shutting down)")


def _ray_gone_under(err: BaseException) -> LaunchError:
    """What a wait raises as, or just after, the driver's Ray shuts down under it (SystemExit, or
    RaySystemError once its implicit start is off: ray_cluster.RayConnection.close)."""
    return stopped_by_shutdown(f"Ray was shut down while this group was working (the launcher is shutting down): "
                               f"{type(err).__name__}")


@dataclass
class GroupTimeouts:
    placement_s: float = 60.0
    """Waiting for Ray to reserve every rank's bundle."""
    startup_s: float = 120.0
    """Actor start: a worker process per rank, then its backend (torch with it) imported
    (describe() and prepare_backend() answered)."""
    rendezvous_s: float = 30.0
    """Joining the process group once every rank runs (seconds when all is well)."""
    load_s: float = 900.0
    """Reading shards and building the model."""
    request_s: float = 600.0
    """One generate call (prefill and the whole decode loop)."""


@dataclass
class TPGroup:
    tp_degree: int
    backend: str
    resources: RankResources
    timeouts: GroupTimeouts = field(default_factory=GroupTimeouts)
    lnc: int = 1
    nodes: int = 1
    """Nodes the group may span: 1 keeps it on one node; more puts a group's ranks on that many
    (TP of them where nodes exceeds TP), each node's share in one bundle (STRICT_SPREAD): TP / nodes
    where nodes divides TP, else ceil or floor of it (node_split), never more than the ceil(TP /
    nodes) the plan gave one node's memory to."""
    name: str = "corelaunch"
    """Placement-group name prefix (the replica pool names each replica's group)."""
    groups: int = 1
    """Groups of this shape the launch asks for at once (its replicas): a placement that times out
    says when the cluster could never hold that many, rather than blaming other groups."""
    actors: list = field(default_factory=list, init=False)
    workers: list[dict] = field(default_factory=list, init=False)
    """describe() of each rank: rank, pid, hostname, node_id, node_ip, devices, accelerator_ids."""
    bundle_of_rank: list[int] = field(default_factory=list, init=False)
    """The placement-group bundle index each rank runs in (ranks are numbered node by node)."""
    _pg: object = field(default=None, init=False, repr=False)
    removed_placement: object = field(default=None, init=False, repr=False)
    """The placement group kill() removed, whose resources Ray hands back a moment later (a shutdown
    waits for them: wait_until_released)."""
    _serve_refs: list = field(default_factory=list, init=False, repr=False)
    _static_ids: int = field(default=0, init=False, repr=False)
    _events: EventChannel | None = field(default=None, init=False, repr=False)
    _heard_at: float = field(default=0.0, init=False, repr=False)
    """When rank 0's last frame arrived (monotonic)."""
    _loops_checked_at: float = field(default=0.0, init=False, repr=False)
    _last_load: dict = field(default_factory=dict, init=False, repr=False)
    _last_counters: dict = field(default_factory=dict, init=False, repr=False)
    _next_call: int = field(default=0, init=False, repr=False)
    _call_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _sender: OrderedSender = field(init=False, repr=False)
    stop_asked: Callable[[], bool] | None = field(default=None, init=False, repr=False)
    """Set by the launcher while it makes this group: True once it is shut down. Placement and every
    wait of start(), load() and start_serving() then stop the group and raise, so a shutdown from
    another thread no longer waits for a whole load (up to --load-timeout) or closes Ray under it."""

    def __post_init__(self) -> None:
        self._sender = OrderedSender(self._send_numbered, name=f"{self.name}-group-calls")

    # ---- start-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Reserve resources, start one actor per rank (node by node), and join their process group."""
        # Looked up at each start, so a test can swap in a misbehaving actor class
        # (monkeypatch ray_worker.RankWorkerActor; tests/fault_actors.py).
        from launcher.cluster import ray_worker

        actor_cls = ray_worker.RankWorkerActor
        _refuse_without_ray()
        placed = self._place_within_nodes()
        _refuse_without_ray()  # Ray shut down while placing: creating the actors would start a new Ray
        # one bundle per node holding its ranks, fullest first: ranks numbered bundle by bundle
        self.bundle_of_rank = self._split_bundle_of_rank() or rank_order(placed) or list(range(self.tp_degree))
        self._placed_node = [placed.get(b, "") for b in self.bundle_of_rank]
        for rank, bundle in enumerate(self.bundle_of_rank):
            spec = WorkerSpec(rank=rank, world_size=self.tp_degree, backend=self.backend,
                              threads=self.resources.threads, lnc=self.lnc)
            actor = actor_cls.options(
                **actor_options(self.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=bundle),
                name=None,
            ).remote(spec)
            self.actors.append(actor)
        started_by = time.monotonic() + self.timeouts.startup_s
        self.workers = self._wait_all([a.describe.remote() for a in self.actors],
                                      self.timeouts.startup_s, "start")
        entry = backend_entry(self.backend)
        if entry.device_files:
            self._check_devices(entry)
        # Importing the backend (torch: seconds a rank, more when several ranks import it at once
        # on a busy host) is part of the start, under its timeout: the rendezvous timeout below
        # then counts the joining alone.
        self._wait_all([a.prepare_backend.remote() for a in self.actors], started_by - time.monotonic(), "start",
                       named_timeout_s=self.timeouts.startup_s)
        rank0 = self.workers[0]
        # Rank 0's store listens on this address alone: loopback when every rank shares its node.
        host = "127.0.0.1" if len(self.node_groups()) == 1 else rank0["node_ip"]
        port = self._wait_all([self.actors[0].rendezvous_port.remote(host)], self.timeouts.rendezvous_s,
                              "choose a rendezvous port", ranks=[0])[0]
        self._rendezvous = host_and_port(host, port)
        # Ranks wait a little longer than the driver does, so a missing rank is reported by the
        # driver (naming every rank still waiting) rather than by rank 0's own rendezvous timeout.
        rank_timeout_s = self.timeouts.rendezvous_s + _RANK_TIMEOUT_MARGIN_S
        self._wait_all([a.init_backend.remote(host, port, rank_timeout_s, self.node_groups())
                        for a in self.actors], self.timeouts.rendezvous_s, "join the process group")

    def node_groups(self) -> list[list[int]]:
        """Ranks grouped by the Ray node they run on, in rank order."""
        groups: dict[str, list[int]] = {}
        for info in self.workers:
            groups.setdefault(info["node_id"], []).append(info["rank"])
        return list(groups.values())

    def _place_within_nodes(self) -> dict[int, str]:
        """_place until Ray's placement spans no more than --nodes nodes and puts no more than
        ceil(TP / --nodes) ranks on one node (each bundle's node): the plan counted cores and memory
        over --nodes, each node's RAM for that many ranks. STRICT_PACK and STRICT_SPREAD keep to
        both (PACK, once used where --nodes did not divide TP, filled the roomiest node first); a
        placement that does not is tried again each second (resources held by others may free up),
        the last try at the end of the placement timeout."""
        deadline, refusal = time.monotonic() + self.timeouts.placement_s, None
        while True:
            # what is left of the one timeout: each try waiting the whole of it let the wait run
            # to about twice --placement-timeout when a try placed late but on too many nodes
            try:
                self._place(deadline - time.monotonic())
            except PlacementTimeout:
                if refusal is None:
                    raise
                raise refusal from None  # the cause, not the last try's short wait
            placed = bundle_nodes(self._pg)
            refusal = self._placement_refusal(placed)
            if refusal is None:
                return placed
            remove_placement_group(self._pg)
            self._pg = None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise refusal
            time.sleep(min(1.0, remaining))  # a last try at the deadline: the wait is the whole timeout

    def _split_bundle_of_rank(self) -> list[int]:
        """The bundle of each rank of a group split over several nodes (node_split), bundle by
        bundle: TP 3 over 2 nodes is [0, 0, 1]. Empty for a group on one node."""
        shares = node_split(self.tp_degree, self.nodes) or []
        return [bundle for bundle, ranks in enumerate(shares) for _ in range(ranks)]

    def _placement_refusal(self, placed: dict[int, str]) -> PlacementTimeout | None:
        """Why this placement breaks the plan, or None: more nodes than --nodes, or more ranks on one
        node than the ceil(TP / --nodes) the plan counted. STRICT_PACK and STRICT_SPREAD keep to
        both; checked all the same, as the plan's memory per node rests on it."""
        used = len(set(placed.values()))
        if used > self.nodes:
            return self._spread_too_wide(used)
        ranks_on = Counter(placed.get(b, "") for b in self._split_bundle_of_rank()) or Counter(placed.values())
        crowded = crowded_node(ranks_on, self.tp_degree, self.nodes)
        return None if crowded is None else self._too_many_on_one_node(*crowded)

    def _spread_too_wide(self, used: int) -> PlacementTimeout:
        return PlacementTimeout(
            f"Ray placed the {self.tp_degree} ranks' bundles of {self.resources.bundle} on {used} nodes, more than "
            f"the {self.nodes} --nodes allows, for {self.timeouts.placement_s:g} s (Ray spread them as the nodes' "
            f"free resources dictated): free resources on fewer nodes, or pass --nodes {used}")

    def _too_many_on_one_node(self, node: str, count: int) -> PlacementTimeout:
        planned = ranks_per_node(self.tp_degree, self.nodes)
        dividing = ", ".join(str(d) for d in divisors(self.tp_degree))
        return PlacementTimeout(
            f"Ray placed {count} of the {self.tp_degree} ranks' bundles of {self.resources.bundle} on one node "
            f"({node[:8]}), more than the {planned} (ceil(TP {self.tp_degree} / --nodes {self.nodes})) the plan gave "
            f"that node's memory to, for {self.timeouts.placement_s:g} s (Ray filled the roomiest nodes "
            f"first): free room on other nodes, or pass a larger --nodes, so each node holds fewer ranks (it need "
            f"not divide TP: a --nodes that divides {self.tp_degree} ({dividing}) only gives every node the same "
            f"share), or a smaller --tp")

    def _place(self, timeout_s: float | None = None) -> None:
        """Reserve the bundles within timeout_s (the placement timeout when None); the message
        names the placement timeout, of which timeout_s is what is left."""
        shares = node_split(self.tp_degree, self.nodes)
        if shares is not None:  # one bundle a node, holding that node's share of the ranks
            bundles = [{name: amount * ranks for name, amount in self.resources.bundle.items()} for ranks in shares]
            strategy = "STRICT_SPREAD"
        else:
            bundles = [dict(self.resources.bundle) for _ in range(self.tp_degree)]
            strategy = placement_strategy(self.nodes)
        # Names are unique in a Ray namespace: several launchers (or a restart racing the removal of
        # the old group) must not collide, so each group gets a random suffix.
        self._pg = placement_group(bundles, strategy=strategy,
                                   name=f"{self.name}-tp{self.tp_degree}-{uuid.uuid4().hex[:8]}")
        if not self._placed_within(self._pg.ready(), self.timeouts.placement_s if timeout_s is None else timeout_s):
            remove_placement_group(self._pg)
            self._pg = None
            nodes = alive_nodes()
            why = explain_unplaceable(self.resources.bundle, self.tp_degree, self.nodes, [n.total for n in nodes],
                                      [n.free for n in nodes], [n.name for n in nodes], groups=self.groups)
            sizes = (f"bundles of {bundles[0]}" if all(b == bundles[0] for b in bundles)
                     else "bundles (" + ", ".join(map(str, bundles)) + ")")  # a node's share each, not split evenly
            raise PlacementTimeout(
                f"Ray could not reserve {len(bundles)} {sizes} ({strategy}) "
                f"within {self.timeouts.placement_s:g} s: {why}"  # which names the way out
            )

    def _placed_within(self, ready: ray.ObjectRef, timeout_s: float) -> bool:
        """The wait for the placement group whose ready() is `ready` (one, asked for at its making:
        each is a task Ray answers in its own time), in slices: a shutdown is seen within _POLL_S."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._unless_stop_asked()
            remaining = deadline - time.monotonic()
            # asked at least once, even with nothing left: a last try at the deadline sees a group placed by then
            if placed_by_now(ready, min(_POLL_S, remaining)):
                # a group removed meanwhile (a shutdown from another thread) reads as ready too: its
                # ready() resolves with an error, which ray.wait does not tell apart
                self._unless_stop_asked()
                return True
            if remaining <= 0:
                return False

    def _unless_stop_asked(self) -> None:
        if self.stop_asked is not None and self.stop_asked():
            self.kill()
            raise stopped_by_shutdown("the launcher was shut down while this group started; the group was stopped")

    def _check_devices(self, entry: BackendEntry) -> None:
        lost = [w for w in self.workers if not w.get("devices")]
        if lost:
            where = ", ".join(sorted({f"node {w['node_ip']} ({w['node_id'][:8]})" for w in lost}))
            ranks = ", ".join(str(w["rank"]) for w in lost)
            self.kill()
            raise DevicesMissing(
                f"{where} declares {entry.ray_resource} to Ray but shows no {entry.name} devices "
                f"({entry.device_files}) to rank(s) {ranks}: its device driver is not loaded or its devices "
                f"were lost. Run `{entry.device_tool}` on that node; restart its Ray node (ray stop; ray start "
                f"...) once the devices are back, or take it out of the cluster so Ray stops placing ranks there"
            )

    def load(self, spec: LoadSpec) -> list[LoadStats]:
        step = LOAD_AND_BUILD_STEP if spec.compile and spec.warm_up else LOAD_STEP
        return self._wait_all([a.load.remote(spec) for a in self.actors], self.timeouts.load_s, step)

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest):
        """One call per rank for the whole batch; rank 0's outputs are returned. While the group
        serves, the batch runs inside the serving loop between two iterations."""
        static_id = None
        if self._serve_refs:
            self._static_ids += 1
            static_id = self._static_ids
        results = self._wait_all([a.generate.remote(request, static_id) for a in self.actors],
                                 self.timeouts.request_s, "finish the request")
        return results[0]

    # ---- serving (continuous batching; workers/serving/) -----------------------------------------
    @property
    def serving(self) -> bool:
        return bool(self._serve_refs)

    def start_serving(self, spec: ServeSpec) -> list[dict]:
        """Allocate every rank's serving cache (building graphs if asked), then start the loops."""
        prepared = self._wait_all([a.prepare_serving.remote(spec) for a in self.actors], self.timeouts.load_s,
                                  "prepare serving")
        _refuse_without_ray()  # the ranks prepared while the launcher may have closed Ray
        self._serve_refs = [a.serve.remote() for a in self.actors]
        self._connect_events()
        return prepared

    def _connect_events(self) -> None:
        """Open the socket rank 0 streams its events over (launcher/cluster/event_channel.py)."""
        same_node = self.workers[0]["node_id"] == ray.get_runtime_context().get_node_id()
        channel = EventChannel("127.0.0.1" if same_node else ray.util.get_node_ip_address())
        self._events = channel
        host, port = channel.address
        connected = self.actors[0].stream_events.remote(host, port, channel.token, self.timeouts.startup_s)

        def connecting_failed() -> None:  # polled while rank 0 connects (up to the start-up timeout)
            self._unless_stop_asked()
            self._check_loops()
            done, _ = ray.wait([connected], timeout=0)
            if done:
                self._wait_all([connected], _POLL_S, "connect its event stream to the driver", ranks=[0])

        try:
            channel.accept(self.timeouts.startup_s, connecting_failed)
        except TimeoutError:
            self.kill()
            raise RendezvousTimeout(f"{self._where(0)} did not connect its event stream to the driver's "
                                    f"{host_and_port(host, port)} within {self.timeouts.startup_s:g} s; the group was stopped. "
                                    f"A firewall between the nodes must let rank 0 reach that port") from None
        self._heard_at = self._loops_checked_at = time.monotonic()
        self._last_load, self._last_counters = {"running": 0, "waiting": 0}, {}

    def submit(self, requests: list) -> None:
        """Hand requests to rank 0's loop (not awaited: a failure shows in the next poll). A group
        already stopped takes nothing; its replica resubmits its streams once restarted. Submissions
        and cancellations are numbered: rank 0 runs them in the order they were sent here
        (workers/serving/numbered_calls.py). Both are sent from the group's own thread, never from
        the caller's Ray task (launcher/cluster/ordered_sender.py)."""
        self._sender.put(("submit_requests", requests))

    def cancel(self, request_ids: list[str]) -> None:
        self._sender.put(("cancel_requests", request_ids))

    def _send_numbered(self, call: tuple[str, list]) -> None:
        method, payload = call
        with self._call_lock:
            if self.actors and not self._ray_gone():
                getattr(self.actors[0], method).remote(payload, self._next_call)
                self._next_call += 1  # only once sent: a number rank 0 never gets would hold every later call

    def poll(self, wait_s: float):
        """(events, load, counters) from rank 0's event stream, waiting up to wait_s for the first
        event; raises the group's fault (WorkerDied, RankFailed, RequestTimeout) when a rank's loop
        ended or rank 0 fell silent, after stopping the group."""
        events = self._events  # once: kill() on another thread (a shutdown) may drop it meanwhile
        if events is None:
            raise RankFailed(f"{self._where(0)} is not serving (the group was stopped)")
        now = time.monotonic()
        if now - self._loops_checked_at >= _LOOP_CHECK_S:  # a follower's death shows here first
            self._loops_checked_at = now
            self._check_loops()
        try:
            messages = events.receive(wait_s)
        except ChannelClosed:
            if self._events is None:
                raise RankFailed(f"{self._where(0)} is not serving (the group was stopped)") from None
            self._stream_closed()
        now = time.monotonic()
        if not messages:
            silent_s = now - self._heard_at
            if silent_s > self.timeouts.startup_s:
                self._check_loops()
                self.kill()
                raise RequestTimeout(f"{self._where(0)} sent nothing for {silent_s:.0f} s (it sends at least once "
                                     f"a second while it serves); the group was stopped")
            return [], dict(self._last_load), dict(self._last_counters)
        self._heard_at = now
        self._last_load, self._last_counters = messages[-1][1], messages[-1][2]
        return [e for events, _, _ in messages for e in events], dict(self._last_load), dict(self._last_counters)

    def _stream_closed(self) -> None:
        """Rank 0's event stream ended while the group serves: its loop ended or its process died.
        Raise that loop's failure (waiting a little for Ray to learn of it), after stopping the group."""
        _refuse_without_ray()
        ray.wait(self._serve_refs[:1], timeout=_ROOT_CAUSE_GRACE_S)  # time for Ray to learn of the end
        self._check_loops()
        # No loop has ended as far as Ray knows yet: ask each rank directly whether its process lives.
        dead = self.dead_ranks(timeout_s=_ROOT_CAUSE_GRACE_S)
        self.kill()
        if dead:
            raise WorkerDied(f"{dead[0]} died while serving (rank 0's event stream ended); the group was stopped")
        raise RankFailed(f"{self._where(0)} closed its event stream while its loop still ran; the group was stopped")

    def _check_loops(self) -> None:
        """Raise (after stopping the group) when any rank's serving loop has ended."""
        _refuse_without_ray()
        done, _ = ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=0)
        if not done:
            return
        rank_of = {ref: rank for rank, ref in enumerate(self._serve_refs)}
        pending = [r for r in self._serve_refs if r not in done]
        failure: Exception | None = None
        for ref in done:
            try:
                ray.get(ref)
                failure = failure or RankFailed(f"{self._where(rank_of[ref])} stopped serving unexpectedly")
            except ray.exceptions.RayActorError as err:
                failure = self._death(rank_of[ref], "serve", err)
                break
            except ray.exceptions.RayTaskError as err:
                failure = failure or _rank_failure(self._where(rank_of[ref]), "serve", err)
            except ray.exceptions.RayError as err:  # Ray's own failure: its result lost with its node, say
                failure = failure or _result_not_returned(self._where(rank_of[ref]), "serve", err)
        if not isinstance(failure, WorkerDied):
            failure = self._find_death(pending, rank_of, "serve") or failure
        if type(failure) is RankFailed and (silent := self.silent_ranks(_ROOT_CAUSE_GRACE_S)):
            # A frozen or cut-off node keeps its connections open: its peers time out in a collective
            # and the first to report names whichever rank it waited on, not the one lost.
            failure = RankFailed(f"{failure}; {', '.join(silent)} did not answer within {_ROOT_CAUSE_GRACE_S:g} s "
                                 f"(its process or node is stopped, or cut off from the others): the likely cause")
        self._serve_refs = []
        self.kill()
        raise failure if isinstance(failure, (RankFailed, WorkerDied)) else RankFailed(str(failure))

    def stop_serving(self, grace_s: float = 10.0) -> list[dict]:
        """End every rank's loop; the loops' counters (steps, forward and planning seconds)."""
        refs, self._serve_refs = self._serve_refs, []
        if not refs or not self.actors or self._ray_gone():
            return []
        self.actors[0].stop_serving.remote()
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        events, self._events = self._events, None
        if events is not None:
            events.close()
        out = []
        for ref in done:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError:
                pass
        return out

    def compile_stats(self, timeout_s: float = 30.0) -> dict | None:
        """Rank 0's graphs built so far and its compile-cache counters (RankWorker.compile_stats);
        every rank builds the same graphs, so rank 0 speaks for all. None when it runs eagerly, or
        does not answer: these are only informational, and a broken group is for the health check
        and the next request to find (this neither waits long nor stops the group)."""
        if not self.actors or self._ray_gone():
            return None
        try:
            return ray.get(self.actors[0].compile_stats.remote(), timeout=timeout_s)
        except ray.exceptions.RayError:
            return None

    def dead_ranks(self, timeout_s: float = 5.0) -> list[str]:
        """Ranks whose process is gone (an idle group's health check); [] when all answer or are busy."""
        if not self.actors or self._ray_gone():
            return ["the group (stopped)"]
        return self._ask_every_rank(timeout_s)[0]

    def silent_ranks(self, timeout_s: float) -> list[str]:
        """Ranks whose actor does not answer a describe() within timeout_s: a stopped process or node
        (a rank's actor answers on a thread of its own while its compute thread is busy)."""
        if not self.actors or self._ray_gone():
            return []
        return self._ask_every_rank(timeout_s)[1]

    def _ask_every_rank(self, timeout_s: float) -> tuple[list[str], list[str]]:
        """Every rank's describe() within timeout_s: (the ranks whose process is gone, the ranks that
        did not answer)."""
        refs = [a.describe.remote() for a in self.actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead, silent = [], []
        for rank, ref in enumerate(refs):
            if ref not in done:
                silent.append(self._where(rank))
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(self._where(rank))
        return dead, silent

    # ---- waiting -----------------------------------------------------------------------------
    def _where(self, rank: int) -> str:
        info = self.workers[rank] if rank < len(self.workers) else {}
        if not info:  # not started yet: name the node Ray placed it on
            placed = getattr(self, "_placed_node", [])
            node = placed[rank][:8] if rank < len(placed) and placed[rank] else "unknown"
            return f"rank {rank} (placed on node {node}, not started)"
        return f"rank {rank} (node {info.get('node_ip', '?')}, pid {info.get('pid', '?')})"

    def _wait_all(self, refs: list, timeout_s: float, step: str, ranks: list[int] | None = None,
                  named_timeout_s: float | None = None) -> list:
        """Results of `refs` in order; raises naming the rank that died or did not finish `step`
        (within `named_timeout_s`, the timeout the message names, when the wait is what is left of it)."""
        ranks = ranks if ranks is not None else list(range(len(refs)))
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            _refuse_without_ray()  # each pass: the launcher may close Ray while this waits (a late restart)
            self._unless_stop_asked()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(rank_of[r] for r in pending)
                self.kill()
                raise self._timeout_error(missing, step, timeout_s if named_timeout_s is None else named_timeout_s)
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=min(_POLL_S, remaining))
            except (SystemExit, ray.exceptions.RaySystemError) as err:
                raise _ray_gone_under(err) from None
            for ref in done:
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RaySystemError as err:
                    raise _ray_gone_under(err) from None
                except ray.exceptions.RayActorError as err:
                    self.kill()
                    raise self._death(rank_of[ref], step, err) from None
                except ray.exceptions.RayTaskError as err:
                    failure = _rank_failure(self._where(rank_of[ref]), step, err)
                    if not isinstance(failure, RankFailed) and self._all_finish(pending):
                        raise failure from None  # every rank refused the same input: the group is intact
                    death = self._find_death(pending, rank_of, step)
                    self.kill()
                    if death is not None:
                        raise death from None
                    raise failure from None
                except ray.exceptions.RayError as err:
                    # Ray's own failure to return the result (ObjectLostError and OwnerDiedError,
                    # lost with its node or owner, are no RayActorError; a crashed worker) is a group
                    # fault too: raised as it was, its ranks were left in a collective and a static
                    # batch was not re-run on a restarted group.
                    death = self._find_death(pending, rank_of, step)
                    self.kill()
                    raise death or _result_not_returned(self._where(rank_of[ref]), step, err) from None
        return [results[r] for r in refs]

    def _death(self, rank: int, step: str, err: Exception) -> WorkerDied:
        return WorkerDied(f"{self._where(rank)} died while trying to {step}: "
                          f"{str(err).splitlines()[0]}; the group was stopped")

    def _all_finish(self, pending: list) -> bool:
        """True when every pending call ends soon and no rank died (nobody is stuck in a collective)."""
        if not pending:
            return True
        done, rest = ray.wait(list(pending), num_returns=len(pending), timeout=_ROOT_CAUSE_GRACE_S)
        if rest:
            return False
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError:
                pass
            except ray.exceptions.RayError:  # a death, or a result lost with its node
                return False
        return True

    def _find_death(self, pending: list, rank_of: dict, step: str) -> WorkerDied | None:
        """A rank among `pending` that died, if one shows up within a short grace period."""
        deadline = time.monotonic() + _ROOT_CAUSE_GRACE_S
        pending = list(pending)
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    return self._death(rank_of[ref], step, err)
                except ray.exceptions.RayError:  # a rank's own error, or a result lost: no death to name
                    pass
        return None

    def _timeout_error(self, missing: list[int], step: str, timeout_s: float) -> LaunchError:
        who = ", ".join(self._where(r) for r in missing)
        if step == "finish the request":
            return RequestTimeout(
                f"{who} did not {step} within {timeout_s:g} s; the group was stopped. Raise "
                f"request_timeout_s (--request-timeout) for long generations, or check that rank's node "
                f"(ray status, its worker log)")
        if step == "join the process group":
            return RendezvousTimeout(
                f"{who} did not join the process group at {getattr(self, '_rendezvous', '?')} within "
                f"{timeout_s:g} s (each rank waits there until all {self.tp_degree} have arrived, so at "
                f"least one of them never did); the group was stopped. Check that every node can reach "
                f"rank 0's node on that port (firewall or security group between nodes), look at those "
                f"ranks' worker logs (ray logs), or raise rendezvous_timeout_s (--rendezvous-timeout)")
        if step == "start":
            return RendezvousTimeout(
                f"{who} did not start within {timeout_s:g} s (starting a worker process and importing the "
                f"backend, torch with it, there); the group was stopped. On a busy machine raise startup_timeout_s "
                f"(--startup-timeout); otherwise check that node (ray status, its worker logs: ray logs)")
        raise_it = {LOAD_STEP: "load_timeout_s (--load-timeout)", LOAD_AND_BUILD_STEP: "load_timeout_s (--load-timeout)",
                    "prepare serving": "load_timeout_s (--load-timeout)",
                    # rank 0's first call, under the rendezvous timeout (TPGroup._start)
                    "choose a rendezvous port": "rendezvous_timeout_s (--rendezvous-timeout)"}.get(step, "the timeout")
        return RendezvousTimeout(
            f"{who} did not {step} within {timeout_s:g} s; the group was stopped. Check that rank's node "
            f"(ray status, its worker log) or raise {raise_it}")

    # ---- teardown ----------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 10.0) -> None:
        """Ask every rank to end its loop and leave its process group within grace_s in all, then
        kill what is left. (Each wait had grace_s of its own: a hung rank held the shutdown twice
        as long as asked.)"""
        deadline = time.monotonic() + grace_s
        if self._serve_refs:
            self.stop_serving(grace_s)
        if self.actors and not self._ray_gone():
            refs = [a.shutdown.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def _ray_gone(self) -> bool:
        """True (the group forgotten, as killed) when Ray is no longer connected: its actors and
        placement group went with the driver's session, and any Ray call now would start a new Ray."""
        if ray.is_initialized():
            return False
        self._serve_refs, self.actors, self._pg = [], [], None
        return True

    def kill(self) -> None:
        self._sender.close(final=True)  # a killed group is thrown away: nothing it is asked later is sent
        self._serve_refs = []
        events, self._events = self._events, None
        if events is not None:
            events.close()
        if self._ray_gone():
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone is what we want
                pass
        self.actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - removal of a group Ray already dropped
                pass
            self.removed_placement, self._pg = self._pg, None


def _result_not_returned(where: str, step: str, err: Exception) -> RankFailed:
    """A rank's call whose result Ray could not hand over, for a reason of Ray's, not the rank's own
    error nor its actor's death (its result lost with its node, its owner dead, its worker crashed)."""
    lines = str(err).strip().splitlines()
    return RankFailed(f"{where}: Ray could not return the result of its call to {step} ({type(err).__name__}: "
                      f"{lines[0] if lines else ''}); the group was stopped")


class RankWriteRefused(RankFailed):
    """A rank's write the filesystem refused (a full disk, a file size limit, a quota: one of
    WRITE_ONLY_ERRNOS), most often the compile cache while it built its graphs. `write_errno` says
    which, so a caller that knows where the rank writes (`corelaunch compile`: into --out) can name
    that place and the fix instead of a group fault."""

    def __init__(self, message: str, write_errno: int, building_graphs: bool) -> None:
        super().__init__(message)
        self.write_errno = write_errno
        self.building_graphs = building_graphs

    def __reduce__(self):  # pickled as Ray copies errors: the default passes only the message
        return type(self), (str(self), self.write_errno, self.building_graphs)


def _rank_failure(where: str, step: str, err: Exception) -> Exception:
    """The error to raise on the driver for an exception raised inside a rank.

    The user's mistakes (a bad checkpoint, a bad value) keep their type so callers can catch them;
    a write the filesystem refused is a RankWriteRefused; anything else is a RankFailed (a group
    fault: restarting the group may cure it). All name the rank and its node.
    """
    cause = getattr(err, "cause", None) or err
    building = _from_the_graph_builder(cause)
    if step in (LOAD_STEP, LOAD_AND_BUILD_STEP) and building:
        step = GRAPH_STEP
    message = f"{where} failed to {step}: {cause}"
    if isinstance(cause, (ValueError, FileNotFoundError)):
        try:
            return type(cause)(message)
        except Exception:  # noqa: BLE001 - a subclass whose constructor takes more (JSONDecodeError, UnicodeDecodeError)
            return (FileNotFoundError if isinstance(cause, FileNotFoundError) else ValueError)(message)
    refused = _write_errno(err, cause, building)
    if refused is not None:
        return RankWriteRefused(message + "; the group was stopped", refused, building)
    return RankFailed(message + "; the group was stopped")


_GRAPH_BUILDER_MODULES = ("torch._dynamo", "torch._inductor")
"""Where the errors of building a graph come from (the compiler's own, and a cache write of it)."""


def _from_the_graph_builder(cause: BaseException) -> bool:
    return type(cause).__module__.startswith(_GRAPH_BUILDER_MODULES)


def _write_errno(err: BaseException, cause: BaseException, building: bool) -> int | None:
    """The WRITE_ONLY_ERRNOS number of a write refused inside the rank, else None. Found on an
    OSError in the exception's chain (a rank's thread, or the OSError itself); a graph builder's
    error also by its words, since it wraps the OSError (or the linker's output, "ld: final link
    failed: No space left on device", which is no OSError at all) and Ray's copy of an exception
    keeps its text but not its chain."""
    from shardlib.atomic_dir import WRITE_ONLY_ERRNOS

    found = next((link.errno for link in error_chain(cause)
                  if isinstance(link, OSError) and link.errno in WRITE_ONLY_ERRNOS), None)
    if found is not None:
        return found
    if building:
        text = f"{cause}\n{err}"  # a RayTaskError's text holds the rank's whole traceback, chain included
        return next((number for number in WRITE_ONLY_ERRNOS if os.strerror(number) in text), None)
    return None
