"""How much of the cluster each rank asks Ray for, and how many torch threads it runs.

CPU backend: the host's CPUs are divided evenly over the ranks. With TP above the core count (a
development and test use) each rank's bundle gets a fraction of a CPU (Ray accepts fractional CPU
bundles) and one thread, so the group still fits; such a run is slower, not wrong.
Neuron backend: a bundle of whole `neuron_cores` (Ray knows no fractions of them) sized by the
plan's cores per rank (the LNC), plus one CPU for the driving process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RankResources:
    bundle: dict[str, float]
    """One placement-group bundle, as Ray takes it."""
    num_cpus: float
    """CPUs the actor itself claims inside its bundle."""
    threads: int
    """torch threads the rank runs."""


def cpu_rank_resources(tp: int, cluster_cpus: float, nodes: int = 1,
                       cpus_per_rank: float | None = None) -> RankResources:
    if cpus_per_rank is None:
        ranks_per_node = math.ceil(tp / max(nodes, 1))
        node_cpus = cluster_cpus / max(nodes, 1)
        share = node_cpus / ranks_per_node
        # whole CPUs when there are enough, else a fraction rounded down to Ray's 1e-4 granularity
        cpus_per_rank = math.floor(share) if share >= 1 else math.floor(share * 1e4) / 1e4
    if cpus_per_rank <= 0:
        raise ValueError(f"cpus_per_rank ({cpus_per_rank}) must be positive")
    threads = max(1, math.floor(cpus_per_rank))
    return RankResources(bundle={"CPU": cpus_per_rank}, num_cpus=cpus_per_rank, threads=threads)


def neuron_rank_resources(cores_per_rank: int) -> RankResources:
    return RankResources(bundle={"neuron_cores": cores_per_rank, "CPU": 1}, num_cpus=1, threads=1)
