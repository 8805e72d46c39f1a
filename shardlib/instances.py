"""The machines the planner knows: AWS Inferentia2 / Trainium instances and this CPU host.

Numbers are the Neuron documentation's (summarised in the README's "Neuron facts the planner
encodes"): NeuronCores per instance, device memory per NeuronCore, the TP degrees NxD Inference
supports per family, and the logical NeuronCore config (LNC). Memory is in GiB of device HBM
(16 GiB per NeuronCore on Inf2 and Trn1, 12 GiB per physical NeuronCore on Trn2, so 24 GiB per
logical core at LNC 2).

`cpu` describes the host the planner runs on (its core count and RAM), for development and tests:
any TP degree is allowed there, even more ranks than cores (ranks then time-share the cores).

`gpu_node(...)` describes a node of GPUs, one per rank, from numbers the caller measured or was
given (this module stays pure: it never looks at devices itself).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

GIB = 2**30

NEURON_FAMILIES = ("inf2", "trn1", "trn2")
FAMILIES = NEURON_FAMILIES + ("cpu", "gpu")
CPU_TARGET = "cpu"
"""The instance name of this host as a planning target."""


@dataclass(frozen=True)
class InstanceType:
    """One kind of machine a TP group can run on (one node of it)."""

    name: str
    """Instance type name as AWS spells it (e.g. "trn1.32xlarge"), or "cpu" for this host."""
    family: str
    """"inf2", "trn1", "trn2", "cpu" or "gpu"; the supported TP degrees and LNCs are per family."""
    physical_cores: int
    """NeuronCores on one instance (CPU cores for "cpu", GPUs for "gpu")."""
    memory_bytes: int
    """Device memory of one instance, all cores together (host RAM for "cpu")."""
    allowed_lncs: tuple[int, ...] = (1,)
    """Logical NeuronCore configs the hardware has: LNC 2 (two physical cores act as one) is Trn2's."""
    default_lnc: int = 1
    core_count_known: bool = True
    """False when the number of cores per node is not known (GPUs of a cluster the planner cannot
    see): physical_cores is then 1 and memory_bytes one core's, and the core count is not checked."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"instance family {self.family!r} must be one of {FAMILIES}")
        if self.physical_cores < 1 or self.memory_bytes < 1:
            raise ValueError(f"{self.name}: physical_cores ({self.physical_cores}) and memory_bytes "
                             f"({self.memory_bytes}) must be positive")
        if self.default_lnc not in self.allowed_lncs:
            raise ValueError(f"{self.name}: default_lnc ({self.default_lnc}) is not in allowed_lncs "
                             f"{self.allowed_lncs}")
        for lnc in self.allowed_lncs:
            if self.physical_cores % lnc:
                raise ValueError(f"{self.name}: {self.physical_cores} cores do not group by LNC {lnc}")

    @property
    def is_neuron(self) -> bool:
        return self.family in NEURON_FAMILIES

    @property
    def per_rank_memory(self) -> bool:
        """True when each rank has the memory of its own cores (devices); False on the cpu host,
        where all ranks share the RAM."""
        return self.family != "cpu"

    @property
    def limits_ranks_per_node(self) -> bool:
        """True when a node's core count bounds its ranks (devices, counted); the cpu host
        time-shares its cores instead."""
        return self.per_rank_memory and self.core_count_known

    def logical_cores(self, lnc: int) -> int:
        """Cores the Neuron runtime shows at this LNC (each drives `lnc` physical cores)."""
        return self.physical_cores // lnc

    @property
    def memory_per_physical_core(self) -> int:
        return self.memory_bytes // self.physical_cores

    def memory_per_logical_core(self, lnc: int) -> int:
        return self.memory_per_physical_core * lnc

    def supported_tp_degrees(self, lnc: int) -> tuple[int, ...] | None:
        """TP degrees NxD Inference supports on one node of this family; None: any degree (cpu, gpu)."""
        if not self.is_neuron:
            return None
        if self.family == "trn2":
            # 64 logical cores at LNC 2 ("TP degree up to 64"); at LNC 1 all 128 cores are visible.
            # 64 ranks a node at LNC 1 stays listed (half of a TP 128 group over 2 nodes), but a TP 64
            # group at LNC 1 is refused by the planner: neuronx-distributed splits that 64-rank
            # world into two groups of 32 (shardlib.planner.TRN2_LNC1_SPLIT_TP).
            return (1, 2, 4, 8, 16, 32, 64) if lnc == 2 else (1, 2, 4, 8, 16, 32, 64, 128)
        return {"inf2": (1, 2, 4, 8, 24), "trn1": (1, 2, 8, 16, 32)}[self.family]


def _neuron(name: str, family: str, cores: int, gib_per_core: int) -> InstanceType:
    lncs = (1, 2) if family == "trn2" else (1,)
    return InstanceType(name=name, family=family, physical_cores=cores, memory_bytes=cores * gib_per_core * GIB,
                        allowed_lncs=lncs, default_lnc=max(lncs))


NEURON_INSTANCES: dict[str, InstanceType] = {
    inst.name: inst
    for inst in (
        _neuron("inf2.xlarge", "inf2", 2, 16),
        _neuron("inf2.8xlarge", "inf2", 2, 16),
        _neuron("inf2.24xlarge", "inf2", 12, 16),
        _neuron("inf2.48xlarge", "inf2", 24, 16),
        _neuron("trn1.2xlarge", "trn1", 2, 16),
        _neuron("trn1.32xlarge", "trn1", 32, 16),
        _neuron("trn1n.32xlarge", "trn1", 32, 16),
        _neuron("trn2.48xlarge", "trn2", 128, 12),
    )
}

INSTANCE_NAMES: tuple[str, ...] = tuple(NEURON_INSTANCES) + (CPU_TARGET,)
"""Every name `get_instance` accepts, in table order."""


def _host_ram_bytes() -> int:
    """This host's RAM, or the memory limit of the cgroup this process runs in where that is lower
    (a container's: shardlib/cgroup_memory.py)."""
    from shardlib.cgroup_memory import cgroup_memory_limit

    limit = cgroup_memory_limit()
    total = _mem_total_bytes()
    return total if limit is None else min(total, limit)


def _mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except OSError:
        pass  # not Linux: fall back to sysconf below
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.lru_cache(maxsize=1)
def cpu_host() -> InstanceType:
    """This host as a planning target: the CPUs this process may use (its affinity and cgroup quota
    counted: shardlib/host_cpus.py) and its RAM (read once per process)."""
    from shardlib.host_cpus import host_cpus

    return InstanceType(name=CPU_TARGET, family="cpu", physical_cores=host_cpus(), memory_bytes=_host_ram_bytes())


def gpu_node(memory_per_gpu: int, gpus: int | None = None, model: str = "GPU") -> InstanceType:
    """A node of `gpus` GPUs of `memory_per_gpu` bytes each, one rank per GPU; gpus=None when the
    count is unknown (then the planner checks memory per rank only, and Ray's placement the count)."""
    each = f"{model} ({memory_per_gpu / GIB:.1f} GiB each)"
    return InstanceType(name=f"{gpus} x {each}" if gpus else f"{each}, count unknown", family="gpu",
                        physical_cores=gpus or 1, memory_bytes=(gpus or 1) * memory_per_gpu,
                        core_count_known=gpus is not None)


def get_instance(name: str) -> InstanceType:
    """The instance type called `name` (one of INSTANCE_NAMES)."""
    if name == CPU_TARGET:
        return cpu_host()
    if name not in NEURON_INSTANCES:
        raise ValueError(f"unknown instance {name!r}; known: {', '.join(INSTANCE_NAMES)}")
    return NEURON_INSTANCES[name]
