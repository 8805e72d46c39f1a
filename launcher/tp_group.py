"""One tensor-parallel group on Ray: placement, actors, rendezvous, loading, requests, teardown.

Every wait on Ray here has a deadline and, when it passes, an error naming what did not arrive and
what to change. A rank that dies is reported with its rank and node; the rest of the group is then
killed so no rank stays blocked in a collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher.errors import LaunchError, PlacementTimeout, RendezvousTimeout, RequestTimeout, WorkerDied
from launcher.ray_worker import RankWorkerActor
from launcher.resources import RankResources
from workers.rank_worker import GenerateRequest, LoadSpec, LoadStats, WorkerSpec

# How often a long wait wakes up to check for dead ranks; a death is seen within this delay.
_POLL_S = 0.5


@dataclass
class GroupTimeouts:
    placement_s: float = 60.0
    """Waiting for Ray to reserve every rank's bundle."""
    startup_s: float = 120.0
    """Actor start and process-group rendezvous (includes importing torch in each worker)."""
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
    name: str = "corelaunch"
    actors: list = field(default_factory=list, init=False)
    workers: list[dict] = field(default_factory=list, init=False)
    """describe() of each rank: rank, pid, hostname, node_id, node_ip."""
    _pg: object = field(default=None, init=False, repr=False)

    # ---- start-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Reserve resources, start one actor per rank, and join their process group."""
        self._place()
        for rank in range(self.tp_degree):
            spec = WorkerSpec(rank=rank, world_size=self.tp_degree, backend=self.backend,
                              threads=self.resources.threads, lnc=self.lnc)
            actor = RankWorkerActor.options(
                num_cpus=self.resources.num_cpus,
                resources={k: v for k, v in self.resources.bundle.items() if k != "CPU"},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank),
                name=None,
            ).remote(spec)
            self.actors.append(actor)
        self.workers = self._wait_all([a.describe.remote() for a in self.actors],
                                      self.timeouts.startup_s, "start")
        rank0 = self.workers[0]
        port = self._wait_all([self.actors[0].rendezvous_port.remote()], self.timeouts.startup_s,
                              "choose a rendezvous port", ranks=[0])[0]
        self._wait_all([a.init_backend.remote(rank0["node_ip"], port, self.timeouts.startup_s,
                                              self.node_groups())
                        for a in self.actors], self.timeouts.startup_s, "join the process group")

    def node_groups(self) -> list[list[int]]:
        """Ranks grouped by the Ray node they run on, in rank order."""
        groups: dict[str, list[int]] = {}
        for info in self.workers:
            groups.setdefault(info["node_id"], []).append(info["rank"])
        return list(groups.values())

    def _place(self) -> None:
        bundles = [dict(self.resources.bundle) for _ in range(self.tp_degree)]
        self._pg = placement_group(bundles, strategy="PACK", name=f"{self.name}-tp{self.tp_degree}")
        if not self._pg.wait(timeout_seconds=self.timeouts.placement_s):
            available = ray.available_resources()
            remove_placement_group(self._pg)
            self._pg = None
            raise PlacementTimeout(
                f"Ray could not reserve {self.tp_degree} bundles of {self.resources.bundle} within "
                f"{self.timeouts.placement_s:.0f} s; the cluster has available "
                f"{ {k: v for k, v in available.items() if not k.startswith('node:')} }. Reduce --tp, "
                f"add nodes, or free the resources held by other jobs"
            )

    def load(self, spec: LoadSpec) -> list[LoadStats]:
        return self._wait_all([a.load.remote(spec) for a in self.actors], self.timeouts.load_s,
                              "load its shard")

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest):
        """One call per rank for the whole batch; rank 0's outputs are returned."""
        results = self._wait_all([a.generate.remote(request) for a in self.actors],
                                 self.timeouts.request_s, "finish the request")
        return results[0]

    # ---- waiting -----------------------------------------------------------------------------
    def _where(self, rank: int) -> str:
        info = self.workers[rank] if rank < len(self.workers) else {}
        node = info.get("node_ip", "unknown node")
        pid = info.get("pid", "?")
        return f"rank {rank} (node {node}, pid {pid})"

    def _wait_all(self, refs: list, timeout_s: float, step: str, ranks: list[int] | None = None) -> list:
        """Results of `refs` in order; raises naming the rank that died or did not finish `step`."""
        ranks = ranks if ranks is not None else list(range(len(refs)))
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(rank_of[r] for r in pending)
                self.kill()
                raise (RequestTimeout if step == "finish the request" else RendezvousTimeout)(
                    f"{', '.join(self._where(r) for r in missing)} did not {step} within "
                    f"{timeout_s:.0f} s; the group was stopped. Check that rank's node (ray status, "
                    f"its worker log) or raise the timeout"
                )
            done, pending = ray.wait(pending, num_returns=1, timeout=min(_POLL_S, remaining))
            for ref in done:
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    rank = rank_of[ref]
                    self.kill()
                    raise WorkerDied(
                        f"{self._where(rank)} died while trying to {step}: "
                        f"{str(err).splitlines()[0]}; the group was stopped"
                    ) from None
                except ray.exceptions.RayTaskError as err:
                    self.kill()
                    raise _rank_failure(self._where(rank_of[ref]), step, err) from None
        return [results[r] for r in refs]

    # ---- teardown ----------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 10.0) -> None:
        """Ask every rank to leave its process group, wait a little, then kill what is left."""
        if self.actors:
            refs = [a.shutdown.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        self.kill()

    def kill(self) -> None:
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
            self._pg = None


def _rank_failure(where: str, step: str, err: Exception) -> Exception:
    """The error to raise on the driver for an exception raised inside a rank.

    The user's mistakes (a bad checkpoint, a bad value) keep their type so callers can catch them;
    anything else is a LaunchError. Both name the rank and its node.
    """
    cause = getattr(err, "cause", None) or err
    message = f"{where} failed to {step}: {cause}"
    if isinstance(cause, (ValueError, FileNotFoundError)):
        return type(cause)(message)
    return LaunchError(message)
