"""Device backends: one registry that every part of corelaunch asks about a backend.

A backend is one module implementing base.Backend plus one BackendEntry in BACKENDS below. Everything
else reads the entry: the CLI's --backend choices, the default backend (the first entry whose device
this host has), what the planner plans against, the Ray resource each rank's bundle asks for, which
devices a rank must see, which WorkerSpec fields the constructor takes and which compile
granularities it honours.

This module imports neither torch nor Ray: the CLI builds its parsers from it. What an entry names
as "module:attribute" is imported only when it is used (on the driver when planning, on a rank
when it starts). The planner targets and device checks live in planner_targets.py, which imports
no torch either, so planning a launch never waits for torch to load.
"""

from __future__ import annotations

import glob
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.granularities import GRANULARITIES

if TYPE_CHECKING:
    from workers.backends.base import Backend


@dataclass(frozen=True)
class TargetRequest:
    """What a backend's planner target is chosen from: the launch's options."""

    instance: str | None = None
    """--instance as given (a Neuron instance type, or "cpu")."""
    device_memory_gib: float | None = None
    """--device-memory-gib as given (the memory of one device)."""
    cluster_on_this_host: bool = True
    """True when the Ray cluster is this machine (no --ray-address, no RAY_ADDRESS): the host's
    devices are then the cluster's, and a device backend can be refused before Ray starts."""


@dataclass(frozen=True)
class BackendEntry:
    """One backend, declared: everything the launcher needs to know without importing it."""

    name: str
    """What users pass as --backend."""
    implementation: str
    """"module:Class" of its base.Backend subclass, imported on the rank that starts it."""
    planner_target: str
    """"module:function" taking a TargetRequest and returning what shardlib.planner.plan plans
    against: an instance name or a shardlib.instances.InstanceType. It raises ValueError, naming
    the fix, when the options do not say enough (or this host cannot run the backend)."""
    description: str
    """One line for --help and messages."""
    detect: str | None = None
    """"module:function" returning True where this host has the device; None: device_files being
    present is the test. The first entry whose device is found is the default backend; an entry
    with neither is the fallback."""
    found_when: str = ""
    """When detect finds the device, in words (for --help)."""
    ray_resource: str | None = None
    """The Ray resource one rank's bundle asks for: one of it (one GPU; one logical NeuronCore,
    as Ray and the Neuron runtime count them at the node's LNC) plus one CPU. None: the rank
    takes a share of the cluster's CPUs instead."""
    constructor_options: tuple[str, ...] = ()
    """WorkerSpec fields passed to the Backend's constructor as keyword arguments."""
    granularities: tuple[str, ...] = ()
    """Compile granularities it honours (workers/granularities.py); () offers no choice."""
    device_files: str | None = None
    """A glob every rank must see on its node (e.g. /dev/neuron[0-9]*): a node that declares
    ray_resource without them is refused before the rendezvous. None: not checked."""
    device_tool: str | None = None
    """The command that lists those devices, named in that refusal."""
    compiled_fp8_kv_cache: bool = True
    """Whether its compiled graphs keep an fp8 KV cache (--kv-cache-dtype) as the eager path does;
    False: the graphs hold the cache in the compute dtype, so the flag is refused with compiling on
    (the planner would count an fp8 cache the device never holds)."""
    compiled_serving: bool = True
    """Whether its compiled model has the serving engine's steps (serve_step at the serving
    shapes, a cache that reports its size). Every command runs the serving engine, so False
    refuses compiling on before Ray starts: the launch died after building every graph."""


BACKENDS: dict[str, BackendEntry] = {entry.name: entry for entry in (
    BackendEntry(
        name="cpu", implementation="workers.backends.cpu:CpuBackend",
        planner_target="workers.backends.planner_targets:cpu_target",
        description="torch on the host CPUs (gloo between nodes, shared memory within one)",
        granularities=GRANULARITIES),
    BackendEntry(
        name="neuron", implementation="workers.backends.neuron:NeuronBackend",
        planner_target="workers.backends.planner_targets:neuron_target",
        description="AWS Trainium/Inferentia through torch-neuronx (unverified)",
        found_when="Neuron devices (/dev/neuron*) exist",
        ray_resource="neuron_cores", constructor_options=("lnc",),
        device_files="/dev/neuron[0-9]*", device_tool="neuron-ls",
        # workers/compiled_neuron.py: the cache is a buffer of the model's dtype, and only the
        # static batch's shapes are traced
        compiled_fp8_kv_cache=False, compiled_serving=False),
    BackendEntry(
        name="cuda", implementation="workers.backends.cuda:CudaBackend",
        planner_target="workers.backends.planner_targets:cuda_target",
        description="NVIDIA GPUs, one per rank, NCCL between them (run at TP 1 on one GPU; NCCL unverified)",
        detect="workers.backends.planner_targets:cuda_devices_present", found_when="torch sees a CUDA GPU",
        ray_resource="GPU", granularities=GRANULARITIES),
)}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend_entry(name: str) -> BackendEntry:
    """The entry called `name`; ValueError naming the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def _load(reference: str):
    module_name, attribute = reference.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def get_backend(name: str, **options) -> "Backend":
    """Instantiate backend `name`; `options` go to its constructor (its entry's constructor_options)."""
    return _load(backend_entry(name).implementation)(**options)


def _is_fallback(entry: BackendEntry) -> bool:
    return entry.detect is None and entry.device_files is None


def _found_here(entry: BackendEntry) -> bool:
    if entry.detect is not None:
        return bool(_load(entry.detect)())
    return bool(glob.glob(entry.device_files))


def default_backend_name() -> str:
    """The first backend whose device this host has, else the fallback (cpu)."""
    for entry in BACKENDS.values():
        if not _is_fallback(entry) and _found_here(entry):
            return entry.name
    return next(entry.name for entry in BACKENDS.values() if _is_fallback(entry))


def backend_help() -> str:
    """Each backend's description and the default-backend rule, for --help."""
    described = "; ".join(f"{e.name}: {e.description}" for e in BACKENDS.values())
    found = [f"{e.name} where {e.found_when}" for e in BACKENDS.values() if not _is_fallback(e)]
    fallback = [e.name for e in BACKENDS.values() if _is_fallback(e)]
    return f"{described}. Default: " + ", ".join(found + [f"else {' or '.join(fallback)}"])


def planner_target(name: str, request: TargetRequest):
    """What backend `name` plans against for these options (see BackendEntry.planner_target)."""
    return _load(backend_entry(name).planner_target)(request)
