"""The Ray actor around workers.rank_worker.RankWorker: adds where the actor runs (node id and IP)
and what the node shows it (Neuron devices, the NeuronCores Ray made visible)."""

from __future__ import annotations

import glob
import os

import ray

from workers.rank_worker import RankWorker, WorkerSpec


class RayRankWorker(RankWorker):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)

    def describe(self) -> dict:
        info = super().describe()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        info["node_ip"] = ray.util.get_node_ip_address()
        # A node can declare neuron_cores to Ray yet have lost its devices (driver unloaded, device
        # fault): the launcher checks this before any rank tries to use them.
        info["neuron_devices"] = sorted(glob.glob("/dev/neuron[0-9]*"))
        info["neuron_rt_visible_cores"] = os.environ.get("NEURON_RT_VISIBLE_CORES")
        return info


# max_restarts=0: a dead rank is reported, never silently restarted by Ray with lost state (the
# launcher restarts the whole group instead); max_concurrency=2 lets a describe/health call through
# while a long generate runs.
RankWorkerActor = ray.remote(max_restarts=0, max_concurrency=2)(RayRankWorker)
