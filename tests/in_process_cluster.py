"""The Launcher without Ray: every replica's TP group as threads of the test process.

`use_in_process_groups(monkeypatch)` makes Launcher.start (and the CLI commands built on it) plan,
size replicas, build the real ReplicaPool and load the tokenizer as usual, but start each TP group
as a `ThreadTPGroup`: one real workers.rank_worker.RankWorker per rank, each call on every rank at
once on threads of this process, the ranks' collectives meeting in memory (tests/tp_harness.py's
InProcessGroup) instead of a torch.distributed process group. Loading (checkpoint slices, shards,
the model), the engine, sampling and the pool's routing, restarts and errors are the production
code; only Ray (actors, placement groups) and the process group are left out. That makes the
driver's logic cheap to test in the fast lane; tests that start real Ray workers are marked slow.

What is replaced, all through monkeypatch:
- launcher.cluster.ray_cluster.connect: no Ray session (a RayConnection that owns nothing);
- launcher.cluster.placement.alive_nodes: one node of `cpus` CPUs, all free;
- launcher.cluster.tp_group.TPGroup: a ThreadTPGroup (Launcher._new_group, the pool's GroupFactory,
  builds, starts and loads it as it would a Ray group);
- workers.backends.BACKENDS["cpu"]: the CPU backend whose process group is an InProcessGroup.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from tests.tp_harness import InProcessGroup
from workers.backends.cpu import CpuBackend
from workers.rank_worker import loop_counters

_GROUPS: dict[int, InProcessGroup] = {}
"""Collective groups by their stand-in rendezvous port (each ThreadTPGroup takes a fresh one)."""
_PORTS = itertools.count(1)
NODE_ID = "in-process-node"


class InProcessCpuBackend(CpuBackend):
    """The CPU backend with its process group replaced: rank `rank` joins the InProcessGroup
    registered under the rendezvous port (the ranks are threads of one process)."""

    def init_process_group(self, rendezvous, rank, world_size, timeout_s, node_groups=None):
        if world_size == 1:
            return super().init_process_group(rendezvous, rank, world_size, timeout_s, node_groups)
        group = _GROUPS[rendezvous.port]
        assert group.world_size == world_size, (group.world_size, world_size)
        return group.ranks()[rank]


@dataclass
class ThreadTPGroup:
    """A TP group (what launcher.cluster.tp_group.TPGroup is to the replica pool) whose ranks are
    RankWorkers on threads of this process. `fail_next(...)` and `kill_rank(...)` inject faults."""

    tp_degree: int
    backend: str = "cpu"
    resources: object = None
    timeouts: object = None
    lnc: int = 1
    nodes: int = 1
    name: str = "in-process"
    groups: int = 1
    actors: list = field(default_factory=list, init=False)
    """The RankWorkers while the group lives; [] once killed (the pool looks at this)."""
    workers: list[dict] = field(default_factory=list, init=False)
    calls: int = field(default=0, init=False)
    """generate calls received."""
    _dead: list[int] = field(default_factory=list, init=False)
    _fault: tuple[BaseException, int] | None = field(default=None, init=False)
    """fail_next's fault and _calls_sent when it was set, in one assignment: the replica's thread
    polls meanwhile, and two assignments let a poll between them see the fault with a stale count."""
    _call_numbers: object = field(default_factory=itertools.count, init=False)
    """Submissions and cancellations numbered as TPGroup numbers them (rank 0 runs them in order)."""
    _fault_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _calls_sent: int = field(default=0, init=False)
    """Submissions sent to rank 0 (fail_next's fault waits for one, or for work already there)."""
    step_limit_s: float = field(default=120.0, init=False)
    """How long a step on every rank (a load with its graphs, a request) may take before the group
    is stopped with a TimeoutError: a stand-in for the timeouts a Ray group's driver enforces."""

    def start(self) -> None:
        from workers.rank_worker import RankWorker, WorkerSpec

        port = next(_PORTS)
        self._port = port
        _GROUPS[port] = self._collectives = InProcessGroup(self.tp_degree, timeout_s=60.0)
        # torch's thread count is the process's: keep it (the backend sets what the spec says).
        threads = torch.get_num_threads()
        self.actors = [RankWorker(WorkerSpec(rank=r, world_size=self.tp_degree, backend="cpu", threads=threads))
                       for r in range(self.tp_degree)]
        self.workers = [dict(w.describe(), node_id=NODE_ID, node_ip="127.0.0.1") for w in self.actors]
        groups = [list(range(self.tp_degree))]
        self._on_every_rank("join the process group",
                            lambda w: w.init_backend("127.0.0.1", port, 60.0, groups))

    def node_groups(self) -> list[list[int]]:
        return [list(range(self.tp_degree))]

    def load(self, spec) -> list:
        return self._on_every_rank("load its shard", lambda w: w.load(spec))

    # ---- serving: the ranks' serving loops on threads, rank 0 reached directly --------------------
    @property
    def serving(self) -> bool:
        return bool(getattr(self, "_serve_threads", None))

    def start_serving(self, spec) -> list:
        prepared = self._on_every_rank("prepare serving", lambda w: w.prepare_serving(spec))
        self._serve_errors: dict[int, BaseException] = {}
        self._static_ids = 0

        def serve(rank: int, worker) -> None:
            try:
                worker.serve()
            except BaseException as err:  # noqa: BLE001 - reported by the next poll
                self._serve_errors[rank] = err

        self._serve_threads = [threading.Thread(target=serve, args=(r, w), daemon=True)
                               for r, w in enumerate(self.actors)]
        for t in self._serve_threads:
            t.start()
        return prepared

    def submit(self, requests) -> None:
        if self.actors:
            self.actors[0].submit_requests(requests, next(self._call_numbers))
            with self._fault_lock:  # after: a poll meanwhile must not fire the fault before the requests are there
                self._calls_sent += 1

    def cancel(self, request_ids) -> None:
        if self.actors:
            self.actors[0].cancel_requests(request_ids, next(self._call_numbers))

    def _raise_injected_fault(self, step: str, at_work: bool = True) -> None:
        """Stop the group and raise what kill_rank / fail_next injected, as a broken group does.
        at_work: the group has requests (fail_next's fault waits for them; a dead rank does not)."""
        from launcher.errors import WorkerDied

        if self._dead:
            self.kill()
            raise WorkerDied(f"rank {self._dead[0]} (in-process, pid {os.getpid()}) died while trying to "
                             f"{step}; the group was stopped")
        taken = None
        if at_work:
            with self._fault_lock:  # a driver's generate and the replica's poll may both get here
                taken, self._fault = self._fault, None
        if taken is not None:
            fault, _ = taken
            self.kill()
            raise fault

    def poll(self, wait_s: float):
        from launcher.errors import RankFailed

        self._raise_injected_fault("serve", at_work=False)
        if self._serve_errors or not self.actors:
            errors = dict(self._serve_errors)
            self.kill()
            rank = min(errors, default=0)
            raise RankFailed(f"rank {rank} (in-process) stopped serving: {errors.get(rank)!r}")
        # What rank 0's event stream carries to a Ray group's driver, taken from its loop directly.
        loop = self.actors[0]._leader_loop()
        events, load = loop.poll(wait_s)
        # fail_next's fault lands on a group at work: the replica polls an idle group all the time,
        # and a fault it took there restarted the group before the test's request reached it (the
        # request then ran once, on the new group). The events polled are lost, as a dead group's are.
        pending = self._fault
        self._raise_injected_fault("serve", at_work=bool(events) or any(load.values())
                                   or (pending is not None and pending[1] != self._calls_sent))
        return events, load, loop_counters(loop)

    def stop_serving(self, grace_s: float = 10.0) -> None:
        threads, self._serve_threads = getattr(self, "_serve_threads", []), []
        if threads and self.actors:
            self.actors[0].stop_serving()
        for t in threads:
            t.join(grace_s)

    def generate(self, request):
        self.calls += 1
        self._raise_injected_fault("finish the request")
        static_id = None
        if self.serving:
            self._static_ids += 1
            static_id = self._static_ids
        return self._on_every_rank("finish the request", lambda w: w.generate(request, static_id))[0]

    def fail_next(self, fault: BaseException) -> None:
        """The next generate, or poll while the group has requests (running, waiting, events not yet
        polled, or submitted since), raises `fault` (a GroupFault) and stops the group, as a broken
        one does."""
        with self._fault_lock:
            self._fault = (fault, self._calls_sent)

    def kill_rank(self, rank: int) -> None:
        """Rank `rank` is gone: the health check reports it, the next request fails with WorkerDied."""
        self._dead.append(rank)

    def compile_stats(self, timeout_s: float = 30.0) -> dict | None:
        """Rank 0's graphs built so far and its compile-cache counters, as TPGroup.compile_stats
        answers (None once the group is stopped, or where rank 0 runs eagerly). Without it the
        pool's compile_stats raised AttributeError, and `corelaunch compile` in-process failed after
        its graphs were built."""
        return self.actors[0].compile_stats() if self.actors else None

    def dead_ranks(self, timeout_s: float = 5.0) -> list[str]:
        if not self.actors:
            return ["the group (stopped)"]
        return [f"rank {r} (in-process, pid {os.getpid()})" for r in self._dead]

    def shutdown(self, grace_s: float = 10.0) -> None:
        self.stop_serving(grace_s)
        if self.actors:
            self._on_every_rank("shut down", lambda w: w.shutdown())
        self.kill()

    def kill(self) -> None:
        if self.actors and self.serving:
            self.actors[0].stop_serving()  # a killed process's loop would be gone too
        self._serve_threads = []
        self.actors = []
        if hasattr(self, "_collectives"):
            self._collectives.abort()  # a rank still waiting in a collective gives up
            _GROUPS.pop(self._port, None)

    def _on_every_rank(self, step: str, fn) -> list:
        """fn(worker) on every rank at once (they meet in collectives); results in rank order.
        Errors as TPGroup raises them: the user's mistakes keep their type, anything else stops
        the group and becomes a RankFailed (launcher.cluster.tp_group._rank_failure)."""
        from launcher.cluster.tp_group import _rank_failure

        workers = list(self.actors)
        results: list = [None] * len(workers)
        errors: dict[int, BaseException] = {}

        def run(rank: int) -> None:
            try:
                results[rank] = fn(workers[rank])
            except BaseException as err:  # noqa: BLE001 - raised below on the caller's thread
                errors[rank] = err

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(workers))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.step_limit_s
        first_error_at = None
        while any(t.is_alive() for t in threads):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.name}: ranks did not {step} within {self.step_limit_s:g} s")
            if errors and first_error_at is None:
                first_error_at = time.monotonic()
            if first_error_at is not None and time.monotonic() - first_error_at > 2.0:
                self._collectives.abort()  # the others wait in a collective for the rank that failed
            next((t for t in threads if t.is_alive()), threads[0]).join(0.02)
        if errors:
            # The rank whose own error it was, not a peer released from a collective by it.
            rank = min(errors, key=lambda r: (isinstance(errors[r], threading.BrokenBarrierError), r))
            failure = _rank_failure(f"rank {rank} (in-process)", step, errors[rank])
            if not isinstance(failure, (ValueError, FileNotFoundError)) or len(errors) < len(workers):
                self.kill()
            raise failure from errors[rank]
        return results


@dataclass
class InProcessCluster:
    """What use_in_process_groups set up: every group the launchers built, in order."""

    cpus: int
    groups: list[ThreadTPGroup] = field(default_factory=list)

    def names(self) -> list[str]:
        """The groups' names (corelaunch-r<replica index>), sorted: one per start or restart."""
        return sorted(g.name for g in self.groups)


def use_in_process_groups(monkeypatch, cpus: int = 2, step_limit_s: float = 120.0) -> InProcessCluster:
    """Make every Launcher started from now on (until monkeypatch undoes it) run in-process.
    step_limit_s: each group's limit on one step of every rank (ThreadTPGroup.step_limit_s); a test
    whose load builds graphs cold on a loaded host needs more than the default."""
    import workers.backends
    from launcher.cluster import placement, ray_cluster, tp_group

    cluster = InProcessCluster(cpus)
    node = placement.NodeInfo(node_id=NODE_ID, address="127.0.0.1", total={"CPU": float(cpus)},
                              free={"CPU": float(cpus)})
    monkeypatch.setattr(ray_cluster, "connect", lambda *args, **kwargs: ray_cluster.RayConnection(
        started_here=False, address="in-process"))
    monkeypatch.setattr(placement, "alive_nodes", lambda: [node])
    # The registry names the class as "module:Class", directly or as a BackendEntry's implementation.
    entry, ours = workers.backends.BACKENDS["cpu"], f"{__name__}:InProcessCpuBackend"
    monkeypatch.setitem(workers.backends.BACKENDS, "cpu", ours if isinstance(entry, str)
                        else dataclasses.replace(entry, implementation=ours))
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))

    def new_group(*args, **kwargs) -> ThreadTPGroup:
        group = ThreadTPGroup(*args, **kwargs)
        group.step_limit_s = step_limit_s
        cluster.groups.append(group)
        return group

    monkeypatch.setattr(tp_group, "TPGroup", new_group)
    return cluster


class TokenGate:
    """Holds the in-process leader loops before they choose more tokens, once `after` steps have
    chosen some, until release() (or `timeout_s`).

    A test that reads a stream's first token and then injects a fault means the fault to land
    mid-request; on a loaded host the loop's thread ran the few remaining steps to the request's end
    before the test's thread set the fault, and the fault landed on the next request instead. Held
    here, the request is still running when the fault is set. Steps after release() run freely, a
    restarted group's too."""

    def __init__(self, monkeypatch, after: int = 1, timeout_s: float = 60.0) -> None:
        from workers.serving.loop import ServingLoop

        self._after, self._timeout_s = after, timeout_s
        self._steps_with_tokens = 0
        self._lock = threading.Lock()
        self._released = threading.Event()
        real_choose = ServingLoop._choose

        def choose_or_hold(loop, *args, **kwargs):
            with self._lock:
                hold = self._steps_with_tokens >= self._after
            if hold and not self._released.wait(self._timeout_s):
                self._released.set()  # timed out once (a test failed before release): not again at every step
            events = real_choose(loop, *args, **kwargs)
            if any(event.token_ids for event in events):
                with self._lock:
                    self._steps_with_tokens += 1
            return events

        monkeypatch.setattr(ServingLoop, "_choose", choose_or_hold)

    def wait_until_held(self, timeout_s: float = 60.0) -> None:
        """Return once `after` steps have chosen tokens (the loop holds before its next choice), or
        raise TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._steps_with_tokens >= self._after:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the loop chose tokens in {self._steps_with_tokens} steps within {timeout_s} s, "
                                   f"not {self._after}")
            time.sleep(0.01)

    def release(self) -> None:
        self._released.set()
