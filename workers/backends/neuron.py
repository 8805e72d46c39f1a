"""Neuron backend (Trainium / Inferentia) — written against the documented torch-neuronx and
neuronx-distributed APIs; UNVERIFIED: no Neuron device exists where corelaunch is developed and tested.

What it does on a Neuron host:
- `setup_process` checks that the runtime LNC matches the plan's LNC (`NEURON_LOGICAL_NC_CONFIG`;
  a graph compiled for one LNC cannot run at another) and sets it. Ray itself sets
  `NEURON_RT_VISIBLE_CORES` for each actor from its `neuron_cores` bundle (one logical core).
- `init_process_group` opens the group's TCPStore at the rendezvous and, before importing anything
  of the SDK (importing torch-neuronx sets the process up from the environment), describes the
  group to torch-neuronx's PJRT client directly: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR/PORT, NEURON_PJRT_PROCESS_INDEX (the rank), NEURON_PJRT_WORLD_SIZE (one device per
  process), PJRT_LOCAL_PROCESS_RANK/COUNT (without them every rank takes itself for the only process
  and a collective reduces over one). It does NOT pose as torchrun (no TORCHELASTIC_RUN_ID): under
  torchrun, newer torch-neuronx sets NEURON_RT_VISIBLE_CORES to LOCAL_RANK, throwing away the core
  Ray gave the rank, so two groups on one node would take the same cores. Off torchrun it leaves
  NEURON_RT_VISIBLE_CORES alone, so each rank keeps Ray's. A root communicator address of the
  group's own (NEURON_RT_ROOT_COMM_ID: a port rank 0 picks; the default is one fixed port per host
  for every group). Then it imports the SDK (a clear error where it is missing or the PyPI
  placeholder), joins torch.distributed over XLA through that store and initialises
  neuronx-distributed's tensor-parallel state with the TP degree and the LNC.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import os
import socket

import torch

from workers.backends.base import (Backend, CompileOptions, RendezvousInfo, leave_torch_distributed,
                                   rendezvous_store)
from workers.collectives import Collectives, TorchDistributedCollectives
from workers.net import address_family, free_port_for_a_late_bind, host_and_port

_INSTALL_HINT = (
    "install the AWS Neuron SDK packages from the AWS Neuron pip repository on a Trainium/Inferentia "
    "host (pip install corelaunch[neuron] --extra-index-url <Neuron pip repository>), or use --backend cpu"
)


def import_neuron_module(name: str):
    """Import a Neuron SDK module, explaining the PyPI placeholder packages when they are what we find."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise RuntimeError(
            f"the neuron backend needs {name!r}, which could not be imported ({err}); the PyPI packages "
            f"named torch-neuronx / neuronx-distributed are placeholders. {_INSTALL_HINT}"
        ) from None


class NeuronBackend(Backend):
    name = "neuron"

    def __init__(self, lnc: int = 1) -> None:
        self.lnc = lnc
        self.ranks_on_this_node = 1
        """The group's ranks on this rank's node (set by init_process_group): they compile at once
        and share the node's CPUs (workers/compiled_neuron.py's compile_workers)."""

    def setup_process(self, rank: int, world_size: int, threads: int) -> None:
        runtime_lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
        if runtime_lnc is not None and runtime_lnc.strip() != str(self.lnc):
            raise RuntimeError(
                f"NEURON_LOGICAL_NC_CONFIG={runtime_lnc} on this host but the plan was made for LNC "
                f"{self.lnc}; compile-time and runtime LNC must be equal: pass --lnc {runtime_lnc} or "
                f"unset the variable"
            )
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(self.lnc)  # before the runtime is loaded
        torch.set_num_threads(max(1, int(threads)))
        # The SDK is imported by init_process_group, once the group is described in the environment:
        # importing torch-neuronx (torch_xla with it) sets the process up from that environment.

    def init_process_group(self, rendezvous: RendezvousInfo, rank: int, world_size: int,
                           timeout_s: float, node_groups: list[list[int]] | None = None) -> Collectives:
        import torch.distributed as dist

        groups = node_groups or [list(range(world_size))]
        self.ranks_on_this_node = len(next(ranks for ranks in groups if rank in ranks))
        # The group's own store, before any SDK import: through it the ranks learn the root
        # communicator's address, which the environment must hold when torch-neuronx sets the
        # process up. The XLA process group then joins through it.
        store = rendezvous_store(rendezvous, rank, world_size, timeout_s)  # on rendezvous.host only
        # The launcher's rendezvous wins over anything inherited from the environment: a stale
        # MASTER_ADDR would send the ranks to different places and they would wait until the timeout.
        for name in INHERITED_VARIABLES_TO_DROP:
            os.environ.pop(name, None)
        os.environ.update(pjrt_environment(rank, world_size, groups, rendezvous))
        os.environ["NEURON_RT_ROOT_COMM_ID"] = shared_root_comm_id(store, rank, rendezvous.host)
        # NEURON_RT_VISIBLE_CORES stays as Ray set it from the actor's neuron_cores bundle: this
        # rank's own core, which off torchrun torch-neuronx does not rewrite.
        import_neuron_module("torch_neuronx")
        import_neuron_module("neuronx_distributed")
        import_neuron_module("torch_xla")
        parallel_state = import_neuron_module("neuronx_distributed.parallel_layers.parallel_state")
        # Registers the "xla" process-group backend with torch.distributed.
        import_neuron_module("torch_xla.distributed.xla_backend")
        dist.init_process_group(backend="xla", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size,
                                                 **lnc_options(parallel_state.initialize_model_parallel, self.lnc))
        return TorchDistributedCollectives()

    @property
    def device(self) -> torch.device:
        # torch_xla.device(): the documented call in current torch-xla; older releases have only
        # xm.xla_device
        torch_xla = import_neuron_module("torch_xla")
        if hasattr(torch_xla, "device"):
            return torch_xla.device()
        return import_neuron_module("torch_xla.core.xla_model").xla_device()

    def prepare_model(self, model: torch.nn.Module, compile: CompileOptions | None = None):
        """Eager: the model on the XLA device, run lazily by torch-xla. Compiled: one Neuron graph per
        bucket traced and compiled with neuronx-distributed's ModelBuilder, saved into
        compile.cache_dir and loaded from there later (workers/compiled_neuron.py; UNVERIFIED).
        A quantized checkpoint's weights first become neuronx-distributed's quantized layers
        (workers/nxd_quantized.py; UNVERIFIED)."""
        if getattr(model.config, "quantization", None) is not None:
            from workers.nxd_quantized import use_nxd_quantized_layers

            use_nxd_quantized_layers(model, import_neuron_module)
        if compile is None:
            return model.to(self.device)
        from workers.compiled_neuron import NeuronCompiledModel

        return NeuronCompiledModel(model, compile.buckets, model.rank, model.layout.tp_degree,
                                   compile.cache_dir, import_neuron_module, lnc=self.lnc,
                                   ranks_on_node=self.ranks_on_this_node)

    def shutdown(self) -> None:
        leave_torch_distributed()


INHERITED_VARIABLES_TO_DROP = ("TORCHELASTIC_RUN_ID",)
"""Variables a worker could inherit (a Ray node started under torchrun, a user's shell) that would
override the group's description: TORCHELASTIC_RUN_ID switches torch-neuronx to its torchrun set-up
(which rewrites NEURON_RT_VISIBLE_CORES to LOCAL_RANK). An inherited
NEURON_PJRT_PROCESSES_NUM_DEVICES is overwritten (pjrt_environment)."""


def pjrt_environment(rank: int, world_size: int, node_groups: list[list[int]],
                     rendezvous: RendezvousInfo) -> dict[str, str]:
    """This rank's place in its group, in the variables torch-neuronx's PJRT client reads: what its
    torchrun set-up would derive from torchrun's variables, minus the core it would pick
    (NEURON_RT_VISIBLE_CORES, Ray's). RANK and LOCAL_RANK are kept too: torch-neuronx copies them
    into NEURON_PJRT_PROCESS_INDEX and PJRT_LOCAL_PROCESS_RANK at import whatever the launcher.
    node_groups: the group's ranks on each node, in rank order."""
    node = next(i for i, ranks in enumerate(node_groups) if rank in ranks)
    local = node_groups[node]
    local_rank, local_world = str(local.index(rank)), str(len(local))
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world,
            "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(len(node_groups)),
            "MASTER_ADDR": rendezvous.host, "MASTER_PORT": str(rendezvous.port),
            "NEURON_PJRT_PROCESS_INDEX": str(rank), "NEURON_PJRT_WORLD_SIZE": str(world_size),
            # the same world as a device count per process (one each): what PJRT clients older than
            # NEURON_PJRT_WORLD_SIZE read, and what every torch-neuronx set-up writes for one device a process
            "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join(["1"] * world_size),
            "PJRT_LOCAL_PROCESS_RANK": local_rank, "PJRT_LOCAL_PROCESS_COUNT": local_world}


_ROOT_COMM_KEY = "corelaunch/neuron_root_comm_id"


def shared_root_comm_id(store, rank: int, host: str) -> str:
    """host:port of the group's root communicator: rank 0 picks a port free on its host and every
    rank reads it from the store (which waits for rank 0). Without it the runtime uses one fixed
    port on each host, which two groups there (replicas) would both take. The runtime binds it
    only once the SDK is imported and the group joined, seconds later: a port below the OS's
    ephemeral range, which no outbound connection's automatic bind takes meanwhile."""
    if rank == 0:
        # free on every address of host's family, the one the runtime binds (rank 0's address may be
        # IPv6: "" checked IPv4 alone); an IPv6 address in brackets, as torch-xla writes it itself
        every_address = "::" if address_family(host) == socket.AF_INET6 else ""
        store.set(_ROOT_COMM_KEY, host_and_port(host, free_port_for_a_late_bind(every_address)))
    return store.get(_ROOT_COMM_KEY).decode()


def lnc_options(initialize_model_parallel, lnc: int) -> dict:
    """initialize_model_parallel's lnc_size where the installed neuronx-distributed takes it (its
    replica groups on trn2 depend on it); older releases lack it, and run only LNC 1."""
    if "lnc_size" in inspect.signature(initialize_model_parallel).parameters:
        return {"lnc_size": lnc}
    if lnc != 1:
        raise RuntimeError(f"the installed neuronx-distributed's initialize_model_parallel takes no lnc_size, so "
                           f"it cannot build LNC {lnc} groups; install a release that does (the Neuron SDK for "
                           f"trn2) or pass --lnc 1")
    return {}
