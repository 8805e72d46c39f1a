"""How Neuron ranks join their group (workers/backends/neuron.py), against stand-in SDK modules.

No Neuron device or SDK exists here. Two ranks run as processes of their own, each importing
stand-ins for torch-neuronx, torch-xla and neuronx-distributed written from the public sources'
behaviour: importing torch-neuronx sets the process up from the environment there and then (it
imports torch-xla). As newer torch-neuronx releases' Initializer does, it copies RANK and LOCAL_RANK
into NEURON_PJRT_PROCESS_INDEX and PJRT_LOCAL_PROCESS_RANK whatever the launcher, and only under
torchrun (TORCHELASTIC_RUN_ID set) fills in the world sizes and sets NEURON_RT_VISIBLE_CORES to
LOCAL_RANK, dropping the core Ray gave the rank. The "xla" process group is gloo under that name, so
the ranks' collective is real. Checked: after the stand-in's set-up each rank still has Ray's core
and the PJRT variables describe the group, one root communicator address serves the group, the LNC
is set, and initialize_model_parallel gets the LNC and a group of both ranks. Whether the real SDK
accepts it is unverified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.backends import neuron
from workers.backends.base import RendezvousInfo

REPO = Path(__file__).resolve().parents[1]

PJRT_KEYS = ("NEURON_PJRT_PROCESS_INDEX", "NEURON_PJRT_WORLD_SIZE", "PJRT_LOCAL_PROCESS_RANK",
             "PJRT_LOCAL_PROCESS_COUNT")

STAND_INS = {
    "torch_neuronx/__init__.py": """
        import json, os
        import torch_xla  # as the real package does: the process is set up at import
        os.environ["NEURON_PJRT_PROCESS_INDEX"] = os.environ.get("RANK", "0")
        os.environ["PJRT_LOCAL_PROCESS_RANK"] = os.environ.get("LOCAL_RANK", "0")
        if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # torchrun's set-up
            if "NEURON_PJRT_PROCESSES_NUM_DEVICES" not in os.environ and "NEURON_PJRT_WORLD_SIZE" not in os.environ:
                os.environ["NEURON_PJRT_WORLD_SIZE"] = os.environ.get("WORLD_SIZE", "1")
                os.environ["PJRT_LOCAL_PROCESS_COUNT"] = os.environ.get("LOCAL_WORLD_SIZE", "1")
            os.environ["NEURON_RT_VISIBLE_CORES"] = os.environ.get("LOCAL_RANK", "0")
        keys = ("TORCHELASTIC_RUN_ID", "NEURON_PJRT_PROCESSES_NUM_DEVICES", "NEURON_RT_VISIBLE_CORES",
                "NEURON_RT_ROOT_COMM_ID", "NEURON_LOGICAL_NC_CONFIG", "NEURON_PJRT_PROCESS_INDEX",
                "NEURON_PJRT_WORLD_SIZE", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT")
        seen = {k: os.environ.get(k) for k in keys}  # what the PJRT client would read
        with open(os.path.join(os.environ["STAND_IN_RECORD"], f"import-{os.environ.get('RANK')}.json"), "w") as f:
            json.dump(seen, f)
    """,
    "torch_xla/__init__.py": "",
    "torch_xla/distributed/__init__.py": "",
    "torch_xla/distributed/xla_backend.py": """
        import torch.distributed as dist
        if "xla" not in dist.Backend.backend_list:
            dist.Backend.register_backend("xla", lambda store, rank, size, timeout: dist.ProcessGroupGloo(
                store, rank, size, timeout))
    """,
    "neuronx_distributed/__init__.py": "",
    "neuronx_distributed/parallel_layers/__init__.py": "",
    "neuronx_distributed/parallel_layers/parallel_state.py": """
        import json, os
        import torch
        import torch.distributed as dist
        def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                      expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1):
            total = torch.ones(1)
            dist.all_reduce(total)  # every rank of the group takes part
            with open(os.path.join(os.environ["STAND_IN_RECORD"], f"parallel-{dist.get_rank()}.json"), "w") as f:
                json.dump({"tp": tensor_model_parallel_size, "lnc_size": lnc_size, "sum": total.item()}, f)
    """,
}

RANK = textwrap.dedent("""
    import os, sys
    from workers.backends.base import RendezvousInfo
    from workers.backends.neuron import NeuronBackend
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    # what Ray gives each rank's actor: its own core; 12 and 13, as for a node's second 2-rank replica
    os.environ["NEURON_RT_VISIBLE_CORES"] = str(12 + rank)
    backend = NeuronBackend(lnc=2)
    backend.setup_process(rank, 2, threads=1)
    backend.init_process_group(RendezvousInfo("127.0.0.1", port), rank, 2, timeout_s=60.0, node_groups=[[0, 1]])
    assert backend.ranks_on_this_node == 2, backend.ranks_on_this_node  # they share the node's CPUs to compile
    backend.shutdown()
""")


def test_two_ranks_are_described_to_the_sdk_before_it_loads(tmp_path):
    from workers.net import free_port_for_a_late_bind

    sdk, record = tmp_path / "sdk", tmp_path / "record"
    record.mkdir()
    for name, text in STAND_INS.items():
        (sdk / name).parent.mkdir(parents=True, exist_ok=True)
        (sdk / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": f"{sdk}{os.pathsep}{REPO}", "STAND_IN_RECORD": str(record),
           # inherited from a shell or a node started under torchrun: must not reach the SDK
           "TORCHELASTIC_RUN_ID": "stale", "NEURON_PJRT_PROCESSES_NUM_DEVICES": "1,1,1,1"}
    for name in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_ROOT_COMM_ID", "RANK", "LOCAL_RANK", *PJRT_KEYS):
        env.pop(name, None)
    port = free_port_for_a_late_bind()  # rank 0 binds it once its interpreter has started
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for proc in ranks:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    imports = [json.loads((record / f"import-{r}.json").read_text()) for r in (0, 1)]
    for r, seen in enumerate(imports):
        assert seen["NEURON_RT_VISIBLE_CORES"] == str(12 + r)  # Ray's core, not LOCAL_RANK's
        # the stale run id dropped, the stale device list (a world of 4) replaced by this group's
        assert seen["TORCHELASTIC_RUN_ID"] is None and seen["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "1,1"
        assert [seen[k] for k in PJRT_KEYS] == [str(r), "2", str(r), "2"]
        assert seen["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert imports[0]["NEURON_RT_ROOT_COMM_ID"] == imports[1]["NEURON_RT_ROOT_COMM_ID"]  # one per group
    assert imports[0]["NEURON_RT_ROOT_COMM_ID"].startswith("127.0.0.1:")
    for r in (0, 1):
        assert json.loads((record / f"parallel-{r}.json").read_text()) == {"tp": 2, "lnc_size": 2, "sum": 2.0}


def test_pjrt_variables_describe_the_rank_within_its_nodes():
    env = neuron.pjrt_environment(2, 4, [[0, 1], [2, 3]], RendezvousInfo("10.0.0.5", 29500))
    assert env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
                   "NEURON_PJRT_PROCESS_INDEX": "2", "NEURON_PJRT_WORLD_SIZE": "4",
                   "PJRT_LOCAL_PROCESS_RANK": "0", "PJRT_LOCAL_PROCESS_COUNT": "2",
                   "NEURON_PJRT_PROCESSES_NUM_DEVICES": "1,1,1,1"}
    assert "TORCHELASTIC_RUN_ID" not in env  # torchrun's set-up would replace Ray's core with LOCAL_RANK


def test_lnc_2_needs_a_neuronx_distributed_that_takes_lnc_size():
    def old_signature(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
        pass

    assert neuron.lnc_options(old_signature, 1) == {}
    with pytest.raises(RuntimeError, match="takes no lnc_size.*pass --lnc 1"):
        neuron.lnc_options(old_signature, 2)


def test_a_runtime_lnc_other_than_the_plans_is_refused(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(RuntimeError, match="NEURON_LOGICAL_NC_CONFIG=1 on this host but the plan was made for LNC 2"):
        neuron.NeuronBackend(lnc=2).setup_process(0, 1, threads=1)


def test_the_root_communicator_address_brackets_an_ipv6_host():
    """host:port with an IPv6 host ("fd00::1:5000") could not be split; torch-xla brackets it."""
    from datetime import timedelta

    import torch.distributed as dist

    from workers.net import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    try:
        assert neuron.shared_root_comm_id(store, 0, "fd00::1").startswith("[fd00::1]:")
        store.delete_key("corelaunch/neuron_root_comm_id")
        assert neuron.shared_root_comm_id(store, 0, "10.0.0.2").startswith("10.0.0.2:")
    finally:
        del store
