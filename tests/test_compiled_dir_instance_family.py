"""A Neuron compiled-model directory records the instance family its graphs were compiled for, and a
launch on another family is refused (launcher/artifacts/compiled_dir.py).

neuronx-cc builds a graph for one platform; a directory compiled on trn1 and copied to a trn2 host
loaded and failed only in the runtime. No Neuron SDK is needed: the check reads the manifest.
"""

from __future__ import annotations

import pytest

from launcher.api import LaunchConfig
from launcher.artifacts import compiled_dir
from tests.test_compile_cli import fake_compiled_dir, model_dir  # noqa: F401 (model_dir: the fixture)


def test_a_neuron_compile_records_the_family_of_its_instance():
    assert compiled_dir.instance_family_field("neuron", "inf2.48xlarge") == {"instance_family": "inf2"}
    assert compiled_dir.instance_family_field("neuron", "trn1n.32xlarge") == {"instance_family": "trn1"}
    assert compiled_dir.instance_family_field("cpu", "cpu") == {}  # the family shapes no CPU graph


def test_a_launch_on_another_family_is_refused_naming_both_and_the_fix(model_dir, tmp_path):  # noqa: F811
    root = fake_compiled_dir(tmp_path / "c", model_dir, backend="neuron", instance="trn1.32xlarge",
                             instance_family="trn1")
    with pytest.raises(ValueError) as err:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), instance="trn2.48xlarge"))
    message = str(err.value)
    assert "compiled for trn1 (--instance trn1.32xlarge), which cannot run on trn2" in message, message
    # no "Compile again" (a neuron compiled directory cannot be built: that command is refused)
    assert message.endswith("this launch is for --instance trn2.48xlarge. Launch on a trn1 instance"), message
    # another size of the same family runs the same graphs
    same_family = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), instance="trn1.2xlarge"))
    assert same_family.backend == "neuron" and same_family.instance == "trn1.2xlarge"
    # a directory compiled before the family was recorded still loads, unchecked
    older = fake_compiled_dir(tmp_path / "old", model_dir, backend="neuron", instance="trn1.32xlarge")
    loaded = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(older), instance="trn2.48xlarge"))
    assert loaded.backend == "neuron"


def test_a_family_no_compile_writes_is_refused_naming_the_field(model_dir, tmp_path):  # noqa: F811
    root = fake_compiled_dir(tmp_path / "c", model_dir, backend="neuron", instance_family="trn9")
    with pytest.raises(ValueError, match=r"field 'instance_family' must be one of inf2, trn1, trn2, found 'trn9'"):
        compiled_dir.read_manifest(root)


def test_a_cpu_launch_of_a_neuron_directory_is_told_the_backend_not_a_family(model_dir, tmp_path):  # noqa: F811
    """The family check ran first and told a cpu launch to `compile --backend neuron --instance cpu`,
    a command that cannot work: a cpu launch meets the backend check, which names the fix."""
    root = fake_compiled_dir(tmp_path / "c", model_dir, backend="neuron", instance="trn1.32xlarge",
                             instance_family="trn1")
    with pytest.raises(ValueError) as err:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), instance="cpu", backend="cpu"))
    message = str(err.value)
    assert "--instance cpu" not in message and "backend: expected 'neuron' (compiled), found 'cpu'" in message, message


def test_a_neuron_compiled_directory_is_refused_naming_its_model_eagerly(model_dir, tmp_path):  # noqa: F811
    """Its graphs cannot run the serving engine (launcher/launch_plan.py compiled_serving_missing), and
    --no-compile beside --compiled is refused: the way out is the model it was compiled from, eager."""
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress

    root = fake_compiled_dir(tmp_path / "c", model_dir, backend="neuron", instance="trn1.32xlarge",
                             instance_family="trn1", source=str(model_dir))
    config = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), instance="trn1.32xlarge"))
    with pytest.raises(ValueError) as err:
        plan_launch(config, Progress(False))
    assert str(err.value).endswith(f"compiled-model directory {root} cannot run. Launch its model eagerly instead: "
                                   f"--model {model_dir} --no-compile, without --compiled"), str(err.value)
