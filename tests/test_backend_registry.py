"""The backend registry (workers/backends/__init__.py) is what every part of corelaunch asks: the CLI's
--backend choices, the default backend, the planner target, the Ray bundles and a rank's constructor
options. A third backend registered here (tests/fake_backend.py) works without editing anything else.
(That the registry and the CLI import neither torch nor Ray: tests/test_check_bench_cli.py.)
The cuda backend is refused, with the fix, before Ray starts on a host without a GPU (this one)."""

from __future__ import annotations

import pytest

from launcher.api import LaunchConfig, Launcher
from launcher.cli import SUBCOMMANDS, build_parser, main
from launcher.cluster.resources import actor_options, missing_resource, rank_resources
from launcher.errors import NoDeviceResource
from launcher.launch_plan import plan_launch
from launcher.progress import Progress
from tests.fake_backend import FAKE_ENTRY
from tests.model_factory import save_random_model
from workers.backends import (BACKENDS, TargetRequest, backend_entry, backend_names, default_backend_name,
                              get_backend, planner_target)

NO_GPU = "this host shows no CUDA GPU to torch"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("m"), "llama", num_heads=4, num_kv_heads=2))


@pytest.fixture
def fake_backend(monkeypatch):
    """Register the test-only backend: one entry, nothing else."""
    monkeypatch.setitem(BACKENDS, FAKE_ENTRY.name, FAKE_ENTRY)
    return FAKE_ENTRY


def backend_choices() -> dict[str, tuple]:
    """--backend's choices of every subcommand that has the option."""
    parser = build_parser()
    [subparsers] = [a for a in parser._actions if a.dest == "command"]
    found = {}
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if "--backend" in action.option_strings:
                found[name] = tuple(action.choices)
    return found


def test_every_command_offers_the_registry_backends():
    choices = backend_choices()
    # plan takes --instance, not --backend; quantize rewrites a checkpoint and runs nothing
    assert set(choices) == set(SUBCOMMANDS) - {"plan", "quantize"}
    assert all(c == backend_names() == ("cpu", "neuron", "cuda") for c in choices.values()), choices


def test_a_registered_backend_is_offered_and_accepted(fake_backend, capsys):
    assert all("fake" in c for c in backend_choices().values())
    args = build_parser().parse_args(["generate", "--backend", "fake", "hello"])
    assert args.backend == "fake"
    assert LaunchConfig(backend="fake").backend == "fake"
    with pytest.raises(ValueError, match="unknown backend 'tpu'; choose one of cpu, neuron, cuda, fake"):
        LaunchConfig(backend="tpu")


# ---- Ray bundles --------------------------------------------------------------------------------
def test_bundles_come_from_the_registry():
    def bundle(name: str) -> dict:
        return rank_resources(backend_entry(name).ray_resource, tp=2, node_cpus=[4.0]).bundle

    assert bundle("cpu") == {"CPU": 2}
    assert bundle("neuron") == {"neuron_cores": 1, "CPU": 1}  # one logical core, whatever the LNC
    assert bundle("cuda") == {"GPU": 1, "CPU": 1}


def test_a_trn2_node_holds_tp_64_at_lnc_2_as_ray_counts_its_cores():
    """Ray's neuron_cores are the cores the Neuron runtime shows (neuron-ls): 64 logical ones on a
    trn2.48xlarge at LNC 2, whose IDs Ray writes into NEURON_RT_VISIBLE_CORES. A rank asked for
    LNC (2) of them: TP 64 needed 128 and named cores 64-127, which the runtime does not have."""
    from launcher.cluster.resources import groups_that_fit
    from shardlib.instances import get_instance
    from shardlib.planner import plan
    from tests.test_planner import LLAMA_405B

    trn2_plan = plan(LLAMA_405B, instance="trn2.48xlarge", tp=64, lnc=2)
    assert trn2_plan.valid and trn2_plan.cores_per_rank == 2  # physical cores driven: reported, not asked of Ray
    trn2 = get_instance("trn2.48xlarge")
    node = {"CPU": 192.0, "neuron_cores": float(trn2.logical_cores(trn2.default_lnc))}
    assert node["neuron_cores"] == 64
    bundle = rank_resources("neuron_cores", tp=64, node_cpus=[192.0]).bundle
    assert groups_that_fit([node], bundle, tp=64, max_nodes=1) == 1


def test_actor_options_claim_gpus_the_way_ray_takes_them():
    gpu = rank_resources("GPU", tp=2, node_cpus=[4.0])
    assert actor_options(gpu) == {"num_cpus": 1, "num_gpus": 1, "resources": {}}
    neuron = rank_resources("neuron_cores", tp=2, node_cpus=[4.0])
    assert actor_options(neuron) == {"num_cpus": 1, "num_gpus": 0, "resources": {"neuron_cores": 1}}


def test_a_registered_backend_gets_its_bundle(fake_backend):
    resources = rank_resources(backend_entry("fake").ray_resource, tp=2, node_cpus=[4.0])
    assert resources.bundle == {"fake_accelerator": 1, "CPU": 1}
    why = missing_resource("fake_accelerator", [{"CPU": 2.0}], ["node a"])
    assert "no alive node of the Ray cluster declares fake_accelerator (node a has {CPU: 2})" in why
    assert missing_resource("fake_accelerator", [{"CPU": 2.0, "fake_accelerator": 1.0}], ["node a"]) is None


# ---- default, planner target, constructor options ---------------------------------------------------
def accelerator_here() -> bool:
    """A CUDA GPU torch can use, or a Neuron device (the registry's device nodes for it): where the
    tests of a plain host do not apply."""
    import glob

    from workers.backends import planner_targets

    return planner_targets.cuda_devices_present() or bool(glob.glob(backend_entry("neuron").device_files))


plain_host_only = pytest.mark.skipif(accelerator_here(), reason="the subject is a host with no GPU and no Neuron "
                                                                 "device, and this one has one")


@plain_host_only
def test_default_backend_is_the_first_device_found():
    assert default_backend_name() == "cpu"  # this host has neither Neuron devices nor a CUDA GPU


def test_a_registered_backend_is_detected_planned_and_constructed(fake_backend, small_model):
    assert default_backend_name() == "fake"  # its detect function says its device is here
    planned = plan_launch(LaunchConfig(model=small_model, tp=2), Progress(False))
    assert planned.backend == "fake" and planned.instance == "cpu" and planned.plan.valid
    backend = get_backend("fake", lnc=2)
    assert backend.name == "fake" and backend.lnc == 2


def test_a_registered_backend_runs_a_rank(fake_backend, small_model):
    """The rank takes its constructor options from the entry (no Ray: the worker class itself)."""
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.rank_worker import GenerateRequest, LoadSpec, RankWorker, WorkerSpec
    from workers.sampling import SamplingParams

    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="fake", threads=1, lnc=2))
    worker.init_backend("127.0.0.1", 0, 10.0)
    assert worker._backend.lnc == 2
    config = load_model_config(small_model)
    worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                         model_dir=small_model))
    [out] = worker.generate(GenerateRequest(prompts=[[5, 17, 42]], params=[SamplingParams()], max_new_tokens=3))
    assert len(out.token_ids) == 3
    worker.shutdown()


def test_planner_targets_per_backend():
    assert planner_target("cpu", TargetRequest()) == "cpu"
    assert planner_target("cpu", TargetRequest(instance="trn1.32xlarge")) == "trn1.32xlarge"
    assert planner_target("neuron", TargetRequest(instance="trn1.32xlarge")) == "trn1.32xlarge"
    with pytest.raises(ValueError, match="the neuron backend needs --instance"):
        planner_target("neuron", TargetRequest())
    with pytest.raises(ValueError, match="--device-memory-gib .* cpu backend plans against this host's RAM"):
        planner_target("cpu", TargetRequest(device_memory_gib=80))
    with pytest.raises(ValueError, match="--instance trn1.32xlarge .* the cuda backend plans against GPU memory"):
        planner_target("cuda", TargetRequest(instance="trn1.32xlarge", device_memory_gib=80))
    # GPUs this host cannot see (a remote cluster): their memory as given, their count left to Ray
    remote = planner_target("cuda", TargetRequest(device_memory_gib=80, cluster_on_this_host=False))
    assert remote.family == "gpu" and remote.memory_per_physical_core == 80 * 2**30
    assert not remote.core_count_known


def test_torch_is_asked_about_cuda_only_where_a_gpu_device_node_exists(tmp_path, monkeypatch):
    import torch

    from workers.backends import planner_targets

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host
    monkeypatch.setattr(planner_targets, "GPU_DEVICE_FILES", (str(tmp_path / "nvidia[0-9]*"),))
    assert planner_targets.cuda_devices_present() is False  # no device node: torch is not asked
    (tmp_path / "nvidia0").touch()
    assert planner_targets.cuda_devices_present() is True


# ---- cuda without a GPU --------------------------------------------------------------------------
@plain_host_only
@pytest.mark.parametrize("options", [{}, {"device_memory_gib": 80}])
def test_cuda_without_a_gpu_is_refused_before_ray_starts(small_model, options):
    launcher = Launcher(model=small_model, backend="cuda", progress=False, **options)
    with pytest.raises(ValueError, match=NO_GPU) as info:
        launcher.start()
    assert "--device-memory-gib" in str(info.value) and "--backend cpu" in str(info.value)
    assert launcher._ray is None and launcher._pool is None  # Ray was never connected to


@plain_host_only
def test_cuda_without_a_gpu_exits_2_from_the_cli(small_model, capsys, ray_tripwire):
    assert main(["generate", "--backend", "cuda", "--model", small_model, "--quiet", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("corelaunch generate: --backend cuda: this host shows no CUDA GPU") and err.count("\n") == 1


@plain_host_only  # the session's Ray declares the host's GPUs
def test_cuda_on_a_cluster_without_gpus_is_refused_before_placement(small_model, ray_session):
    import ray

    # The test session's cluster, named explicitly: a cluster elsewhere as far as planning knows.
    launcher = Launcher(model=small_model, backend="cuda", device_memory_gib=80, progress=False,
                        ray_address=ray.get_runtime_context().gcs_address)
    with pytest.raises(NoDeviceResource, match="the cuda backend's ranks need GPU, but no alive node .* declares GPU"):
        launcher.start()
    assert launcher._pool is None


@pytest.mark.slow
@plain_host_only  # a host whose private Ray declares no neuron_cores
def test_a_private_cluster_without_the_backends_devices_is_bad_input_exit_2():
    """The launch's own private Ray (this host alone) can never hold a neuron rank here: it exited 3,
    "running it again unchanged may succeed", where a group that cluster can never hold is exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    from launcher.cli.exit_codes import exit_code_for
    from launcher.errors import NoDeviceResourceHere

    assert exit_code_for(NoDeviceResourceHere("x")) == 2 and exit_code_for(NoDeviceResource("x")) == 3
    out = subprocess.run([sys.executable, "-m", "launcher", "generate", "--backend", "neuron", "--no-compile",
                          "--instance", "trn1.32xlarge", "--tp", "1", "--seq-len", "64", "--quiet", "hi"],  # the built-in model
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2, out.stderr[-2000:]
    assert "the neuron backend's ranks need neuron_cores, but no alive node" in out.stderr, out.stderr[-2000:]


def test_a_cuda_rank_that_sees_more_than_its_own_gpu_is_refused(monkeypatch):
    """Ray leaves each rank one visible GPU, so a rank uses cuda:0; where Ray was told not to set
    CUDA_VISIBLE_DEVICES, every rank of a node took the first GPU."""
    import torch

    from workers.backends import get_backend

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(RuntimeError, match=r"sees 4 GPUs \(CUDA_VISIBLE_DEVICES='0,1,2,3'\) .* unset "
                                           r"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        get_backend("cuda").setup_process(rank=1, world_size=4, threads=1)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    get_backend("cuda").setup_process(rank=1, world_size=4, threads=torch.get_num_threads())
    assert calls == [torch.device("cuda", 0)]
