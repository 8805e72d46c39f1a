"""Neuron backend (Trainium / Inferentia) — written against the documented torch-neuronx and
neuronx-distributed APIs; UNVERIFIED: no Neuron device exists where corelaunch is developed and tested.

What it does on a Neuron host:
- `setup_process` checks that the real Neuron libraries are importable (the PyPI packages of the same
  names are placeholders raising ImportError) and that the runtime LNC matches the plan's LNC
  (`NEURON_LOGICAL_NC_CONFIG`; a graph compiled for one LNC cannot run at another). Ray itself sets
  `NEURON_RT_VISIBLE_CORES` for each actor from its `neuron_cores` bundle.
- `init_process_group` joins torch.distributed over the XLA backend and initialises
  neuronx-distributed's tensor-parallel state with the group's TP degree.
"""

from __future__ import annotations

import datetime
import importlib
import os

import torch

from workers.backends.base import Backend, CompileOptions, RendezvousInfo, leave_torch_distributed
from workers.collectives import Collectives, TorchDistributedCollectives

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

    def setup_process(self, rank: int, world_size: int, threads: int) -> None:
        import_neuron_module("torch_neuronx")
        import_neuron_module("neuronx_distributed")
        runtime_lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
        if runtime_lnc is not None and int(runtime_lnc) != self.lnc:
            raise RuntimeError(
                f"NEURON_LOGICAL_NC_CONFIG={runtime_lnc} on this host but the plan was made for LNC "
                f"{self.lnc}; compile-time and runtime LNC must be equal: pass --lnc {runtime_lnc} or "
                f"unset the variable"
            )
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(self.lnc)
        torch.set_num_threads(max(1, int(threads)))

    def init_process_group(self, rendezvous: RendezvousInfo, rank: int, world_size: int,
                           timeout_s: float, node_groups: list[list[int]] | None = None) -> Collectives:
        import torch.distributed as dist

        import_neuron_module("torch_xla")
        parallel_state = import_neuron_module("neuronx_distributed.parallel_layers.parallel_state")
        # Registers the "xla" process-group backend with torch.distributed.
        import_neuron_module("torch_xla.distributed.xla_backend")
        # The launcher's rendezvous wins over anything inherited from the environment: a stale
        # MASTER_ADDR would send the ranks to different places and they would wait until the timeout.
        os.environ["MASTER_ADDR"] = rendezvous.host
        os.environ["MASTER_PORT"] = str(rendezvous.port)
        dist.init_process_group(backend="xla", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        return TorchDistributedCollectives()

    @property
    def device(self) -> torch.device:
        xla_model = import_neuron_module("torch_xla.core.xla_model")
        return xla_model.xla_device()

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
                                   compile.cache_dir, import_neuron_module, lnc=self.lnc)

    def shutdown(self) -> None:
        leave_torch_distributed()
