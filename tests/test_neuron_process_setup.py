"""How a Neuron rank joins its group (workers/backends/neuron.py), against stand-in SDK modules.

No Neuron device or SDK exists here. These check corelaunch's side of what the documented APIs
expect: the torchrun variables torch-neuronx's multi-process set-up reads (without them each rank
takes itself for the only process), present before the SDK is imported and the process group is
joined; one root communicator address per group, picked by rank 0 and shared through the group's
store; the LNC set before the runtime loads and passed to initialize_model_parallel where the
installed neuronx-distributed takes it. Whether the real SDK accepts it is unverified.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch.distributed as dist

from workers.backends import neuron
from workers.backends.base import RendezvousInfo

SET_BY_THE_BACKEND = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NEURON_RT_ROOT_COMM_ID",
                      "NEURON_LOGICAL_NC_CONFIG")


@pytest.fixture
def stand_in_sdk(monkeypatch):
    """Stand-in modules for torch-neuronx, torch-xla and neuronx-distributed that record the
    environment each step sees; torch.distributed's join recorded instead of made."""
    for name in SET_BY_THE_BACKEND:  # restored after the test, whatever the backend sets
        monkeypatch.delenv(name, raising=False)
    seen: dict[str, dict] = {}

    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1):
        seen["initialize_model_parallel"] = dict(os.environ, tp=tensor_model_parallel_size, lnc_size=lnc_size)

    parallel_state = types.ModuleType("neuronx_distributed.parallel_layers.parallel_state")
    parallel_state.initialize_model_parallel = initialize_model_parallel
    modules = {"torch_neuronx": types.ModuleType("torch_neuronx"), "torch_xla": types.ModuleType("torch_xla"),
               "torch_xla.distributed": types.ModuleType("torch_xla.distributed"),
               "torch_xla.distributed.xla_backend": types.ModuleType("torch_xla.distributed.xla_backend"),
               "neuronx_distributed": types.ModuleType("neuronx_distributed"),
               "neuronx_distributed.parallel_layers": types.ModuleType("neuronx_distributed.parallel_layers"),
               "neuronx_distributed.parallel_layers.parallel_state": parallel_state}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    real_import = neuron.import_neuron_module

    def recording_import(name):
        seen.setdefault("imports", []).append((name, dict(os.environ)))
        return real_import(name)

    monkeypatch.setattr(neuron, "import_neuron_module", recording_import)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kwargs: seen.setdefault("init_process_group", dict(os.environ, **kwargs)))
    monkeypatch.setattr(neuron, "TorchDistributedCollectives", lambda: "collectives")  # no group was made
    store = dist.HashStore()
    monkeypatch.setattr(neuron, "default_store", lambda: store)
    return seen, parallel_state


def test_torchrun_variables_describe_the_rank_within_its_nodes():
    env = neuron.torchrun_environment(2, 4, [[0, 1], [2, 3]], RendezvousInfo("10.0.0.5", 29500))
    assert env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
                   "TORCHELASTIC_RUN_ID": "corelaunch-10.0.0.5-29500"}
    assert neuron.torchrun_environment(0, 4, [[0, 1], [2, 3]], RendezvousInfo("10.0.0.5", 29500))[
        "TORCHELASTIC_RUN_ID"] == env["TORCHELASTIC_RUN_ID"]  # one run id for the whole group


def test_a_rank_joins_with_the_torchrun_variables_set_before_the_sdk_loads(stand_in_sdk):
    seen, _ = stand_in_sdk
    backend = neuron.NeuronBackend(lnc=2)
    rendezvous = RendezvousInfo("127.0.0.1", 29500)
    ids = []
    for rank in (0, 1):  # rank 0 first: it puts the root communicator's address in the store
        backend.setup_process(rank, 2, threads=1)
        backend.init_process_group(rendezvous, rank, 2, timeout_s=5.0, node_groups=[[0, 1]])
        torch_xla_import = next(env for name, env in seen["imports"][::-1] if name == "torch_xla")
        assert torch_xla_import["RANK"] == str(rank) and torch_xla_import["WORLD_SIZE"] == "2"
        assert torch_xla_import["LOCAL_WORLD_SIZE"] == "2" and torch_xla_import["TORCHELASTIC_RUN_ID"]
        assert torch_xla_import["MASTER_ADDR"] == "127.0.0.1" and torch_xla_import["MASTER_PORT"] == "29500"
        assert seen["init_process_group"]["backend"] == "xla"
        ids.append(seen["initialize_model_parallel"]["NEURON_RT_ROOT_COMM_ID"])
        assert seen["initialize_model_parallel"]["tp"] == 2 and seen["initialize_model_parallel"]["lnc_size"] == 2
        seen.pop("init_process_group")
    assert ids[0] == ids[1] and ids[0].startswith("127.0.0.1:")  # one address for the group, rank 0's port
    runtime_import = next(env for name, env in seen["imports"] if name == "torch_neuronx")
    assert runtime_import["NEURON_LOGICAL_NC_CONFIG"] == "2"  # set before the runtime loads


def test_lnc_2_needs_a_neuronx_distributed_that_takes_lnc_size():
    def old_signature(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
        pass

    assert neuron.lnc_options(old_signature, 1) == {}
    with pytest.raises(RuntimeError, match="takes no lnc_size.*pass --lnc 1"):
        neuron.lnc_options(old_signature, 2)


def test_a_runtime_lnc_other_than_the_plans_is_refused(monkeypatch, stand_in_sdk):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(RuntimeError, match="NEURON_LOGICAL_NC_CONFIG=1 on this host but the plan was made for LNC 2"):
        neuron.NeuronBackend(lnc=2).setup_process(0, 1, threads=1)
