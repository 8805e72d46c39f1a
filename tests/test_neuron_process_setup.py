"""How Neuron ranks join their group (workers/backends/neuron.py), against stand-in SDK modules.

No Neuron device or SDK exists here. Two ranks run as processes of their own, each importing
stand-ins for torch-neuronx, torch-xla and neuronx-distributed written from the public sources'
behaviour: importing torch-neuronx sets the process up from the environment there and then (it
imports torch-xla), and under torchrun (TORCHELASTIC_RUN_ID) it keeps the LOCAL_RANK-th core of
NEURON_RT_VISIBLE_CORES, refusing a list whose length is not LOCAL_WORLD_SIZE. The "xla" process
group is gloo under that name, so the ranks' collective is real. Checked: the torchrun variables,
the node's cores and one root communicator address are in the environment before the SDK is
imported, the LNC too, and initialize_model_parallel gets the LNC and a group of both ranks.
Whether the real SDK accepts it is unverified.
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

STAND_INS = {
    "torch_neuronx/__init__.py": """
        import json, os
        import torch_xla  # as the real package does: the process is set up at import
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID", "NEURON_LOGICAL_NC_CONFIG")
        seen = {k: os.environ.get(k) for k in keys}
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun: keep this rank's core of the node's
            cores = [c for c in os.environ.get("NEURON_RT_VISIBLE_CORES", "").split(",") if c]
            local_world = int(os.environ["LOCAL_WORLD_SIZE"])
            if not (len(cores) <= 1 and local_world == 1):
                if len(cores) != local_world:
                    raise ValueError(f"LOCAL_WORLD_SIZE {local_world} is not equal to count {len(cores)} "
                                     f"from NEURON_RT_VISIBLE_CORES {cores}")
                os.environ["NEURON_RT_VISIBLE_CORES"] = cores[int(os.environ["LOCAL_RANK"])]
        seen["kept_core"] = os.environ.get("NEURON_RT_VISIBLE_CORES")
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
    os.environ["NEURON_RT_VISIBLE_CORES"] = str(10 + rank)  # what Ray gives each rank's actor: its own core
    backend = NeuronBackend(lnc=2)
    backend.setup_process(rank, 2, threads=1)
    backend.init_process_group(RendezvousInfo("127.0.0.1", port), rank, 2, timeout_s=60.0, node_groups=[[0, 1]])
    backend.shutdown()
""")


def test_two_ranks_are_described_to_the_sdk_before_it_loads(tmp_path):
    from workers.net import free_port_for_a_late_bind

    sdk, record = tmp_path / "sdk", tmp_path / "record"
    record.mkdir()
    for name, text in STAND_INS.items():
        (sdk / name).parent.mkdir(parents=True, exist_ok=True)
        (sdk / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": f"{sdk}{os.pathsep}{REPO}", "STAND_IN_RECORD": str(record)}
    for name in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_ROOT_COMM_ID", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    port = free_port_for_a_late_bind()  # rank 0 binds it once its interpreter has started
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for proc in ranks:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    imports = [json.loads((record / f"import-{r}.json").read_text()) for r in (0, 1)]
    for r, seen in enumerate(imports):
        assert (seen["RANK"], seen["WORLD_SIZE"], seen["LOCAL_RANK"], seen["LOCAL_WORLD_SIZE"]) == (str(r), "2", str(r), "2")
        assert seen["MASTER_ADDR"] == "127.0.0.1" and seen["MASTER_PORT"] == str(port) and seen["TORCHELASTIC_RUN_ID"]
        assert seen["NEURON_RT_VISIBLE_CORES"] == "10,11" and seen["kept_core"] == str(10 + r)  # its own, by remap
        assert seen["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert imports[0]["NEURON_RT_ROOT_COMM_ID"] == imports[1]["NEURON_RT_ROOT_COMM_ID"]  # one per group
    assert imports[0]["NEURON_RT_ROOT_COMM_ID"].startswith("127.0.0.1:")
    for r in (0, 1):
        assert json.loads((record / f"parallel-{r}.json").read_text()) == {"tp": 2, "lnc_size": 2, "sum": 2.0}


def test_torchrun_variables_describe_the_rank_within_its_nodes():
    env = neuron.torchrun_environment(2, 4, [[0, 1], [2, 3]], RendezvousInfo("10.0.0.5", 29500))
    assert env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
                   "TORCHELASTIC_RUN_ID": "corelaunch-10.0.0.5-29500"}
    assert neuron.torchrun_environment(0, 4, [[0, 1], [2, 3]], RendezvousInfo("10.0.0.5", 29500))[
        "TORCHELASTIC_RUN_ID"] == env["TORCHELASTIC_RUN_ID"]  # one run id for the whole group


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
