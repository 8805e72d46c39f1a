"""The Ray actor around workers.rank_worker.RankWorker: adds where the actor runs (node id and IP)
and what the node shows it (its backend's device files, the accelerators Ray made visible)."""

from __future__ import annotations

import glob
import sys
from concurrent.futures import ThreadPoolExecutor, wait

import ray

from workers.backends import backend_entry
from workers.rank_worker import RankWorker, WorkerSpec

SHUTDOWN_RELEASE_WAIT_S = 5.0
"""How long shutdown waits for the compute thread to drop the model and leave the process group,
once the serving loop has ended (or had its collectives closed under it)."""


class RayRankWorker(RankWorker):
    """Every step that runs torch (join, load, compile, generate, shutdown) runs on one thread of
    its own, whichever of Ray's actor threads the call arrives on.

    Why: a threaded actor runs calls on a pool of threads, and each thread that enters an OpenMP
    parallel region gets an OpenMP team of its own. Once the process holds more OpenMP threads than
    it has cores, libgomp stops spinning between parallel regions and puts its threads to sleep
    after each one, and a compiled decode step enters hundreds of them: SmolLM2 TP 1 decoded at
    ~22 tokens/s with load and generate on different threads against ~40-46 with both on one
    thread (2 threads, development machine)."""

    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        # With worker logs forwarded (ray_cluster.connect), Ray prints a worker's stdout on the
        # driver's stdout, which carries `--json` output: whatever Python code here prints goes
        # to stderr instead.
        sys.stdout = sys.stderr
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corelaunch-compute")

    def __repr__(self) -> str:
        # Ray names the actor by this in forwarded log lines: "(rank 0 pid=...) corelaunch: ..."
        return f"rank {self.spec.rank}"

    def prepare_backend(self):  # on the compute thread: torch's thread settings are made where it computes
        return self._compute.submit(super().prepare_backend).result()

    def init_backend(self, *args, **kwargs):
        return self._compute.submit(super().init_backend, *args, **kwargs).result()

    def load(self, load_spec):
        return self._compute.submit(super().load, load_spec).result()

    def generate(self, request, static_id=None):
        # A batch numbered for the serving loop (static_id) is that loop's to run, on the compute
        # thread it holds; RankWorker.generate refuses it when the loop has ended meanwhile.
        if static_id is not None or self._loop is not None:
            return super().generate(request, static_id)
        return self._compute.submit(super().generate, request).result()

    def prepare_serving(self, spec):
        return self._compute.submit(super().prepare_serving, spec).result()

    def serve(self):
        return self._compute.submit(super().serve).result()

    def shutdown(self) -> None:
        try:
            # Here, on the actor's thread: the compute thread may be held by a serving loop stuck in
            # a collective for a peer that died, which only closing the collectives under it ends
            # (a shutdown queued behind it on the compute thread waited until the launcher killed
            # the actor).
            self._end_serving()
            release = self._compute.submit(self._release)
            # waited for, then read: result(timeout=) raises the builtin TimeoutError for a release
            # that itself failed with one too, which this message would have misnamed
            if not wait([release], timeout=SHUTDOWN_RELEASE_WAIT_S).done:
                raise TimeoutError(
                    f"rank {self.spec.rank}: its compute thread was still busy {SHUTDOWN_RELEASE_WAIT_S:g} s after "
                    f"the serving loop was stopped (a static batch or a step stuck in the process group), so the "
                    f"process group was not left; the launcher kills the actor")
            release.result()  # its own error, as it was
        finally:
            self._compute.shutdown(wait=False)

    def describe(self) -> dict:
        info = super().describe()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        info["node_ip"] = ray.util.get_node_ip_address()
        # A node can declare a device resource to Ray yet have lost its devices (driver unloaded,
        # device fault): the launcher checks this before any rank tries to use them.
        pattern = backend_entry(self.spec.backend).device_files
        info["devices"] = sorted(glob.glob(pattern)) if pattern else None
        info["accelerator_ids"] = ray.get_runtime_context().get_accelerator_ids()
        return info


# max_restarts=0: a dead rank is reported, never silently restarted by Ray with lost state (the
# launcher restarts the whole group instead); max_concurrency: the serving loop holds one actor
# thread for as long as it serves, a static batch one more, and polls, submissions, cancellations
# and health checks must still get through.
ACTOR_OPTIONS = dict(max_restarts=0, max_concurrency=8)
RankWorkerActor = ray.remote(**ACTOR_OPTIONS)(RayRankWorker)
