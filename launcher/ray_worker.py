"""The Ray actor around workers.rank_worker.RankWorker: adds where the actor runs (node id and IP)."""

from __future__ import annotations

import ray

from workers.rank_worker import RankWorker, WorkerSpec


class RayRankWorker(RankWorker):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)

    def describe(self) -> dict:
        info = super().describe()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        info["node_ip"] = ray.util.get_node_ip_address()
        return info


# max_restarts=0: a dead rank is reported, never silently restarted with lost state;
# max_concurrency=2 lets a describe/health call through while a long generate runs.
RankWorkerActor = ray.remote(max_restarts=0, max_concurrency=2)(RayRankWorker)
