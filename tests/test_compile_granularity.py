"""--granularity / LaunchConfig.compile_granularity: checked before anything starts, carried to the
ranks in LoadSpec.compile_granularity, held to a compiled-model directory's choice."""

from __future__ import annotations

import pytest

from launcher.api import LaunchConfig
from launcher.artifacts.compiled_dir import apply_compiled_dir, load_spec_fields
from launcher.cli import build_parser
from launcher.cli.generate_command import launch_config
from launcher.launch_plan import plan_launch
from launcher.progress import Progress
from tests.model_factory import save_random_model
from tests.test_compile_cli import fake_compiled_dir
from workers.granularities import GRANULARITIES


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("m"), "llama", num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("command", ["generate", "compile"])
def test_both_commands_offer_every_granularity(command):
    parser = build_parser()
    for name in GRANULARITIES:
        extra = ["--out", "x"] if command == "compile" else ["hello"]
        assert parser.parse_args([command, "--granularity", name, *extra]).granularity == name


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_granularity_reaches_the_load_spec_at_tp2(small_model, granularity):
    args = build_parser().parse_args(["generate", "--model", str(small_model), "--tp", "2", "--buckets", "16",
                                      "--granularity", granularity, "hello"])
    config = launch_config(args)
    planned = plan_launch(config, Progress(False))
    fields = load_spec_fields(config, planned.plan, planned.model_config)
    assert fields["compile"] and fields["compile_granularity"] == granularity


def test_no_granularity_leaves_the_backend_default():
    assert LaunchConfig().compile_granularity is None


@pytest.mark.parametrize("options, message", [
    (dict(compile_granularity="graph"), "compile_granularity ('graph') must be one of model, layer, model-decode, collective"),
    (dict(compile_granularity="model", compile=False), "compile is False (--no-compile)"),
])
def test_bad_granularities_are_refused_naming_the_value(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LaunchConfig(**options)


def test_a_backend_without_the_choice_refuses_it(small_model):
    config = LaunchConfig(model=str(small_model), backend="neuron", instance="trn1.32xlarge", compile_granularity="model")
    with pytest.raises(ValueError, match="the neuron backend offers no choice of granularity; drop --granularity"):
        plan_launch(config, Progress(False))


def test_a_compiled_directory_keeps_its_granularity(small_model, tmp_path):
    root = fake_compiled_dir(tmp_path / "c", small_model, granularity="model")
    assert apply_compiled_dir(LaunchConfig(compiled_dir=str(root))).compile_granularity == "model"
    with pytest.raises(ValueError, match=r"launch: compile_granularity: expected 'model' \(compiled\), found 'layer' \(asked\)"):
        apply_compiled_dir(LaunchConfig(compiled_dir=str(root), compile_granularity="layer"))


def test_a_backend_whose_graphs_hold_no_fp8_cache_refuses_one_when_compiling(small_model):
    """The Neuron graphs keep the KV cache in the compute dtype while the planner counted an fp8 one:
    a quarter of a float32 cache planned, the whole allocated on the device."""
    options = dict(model=str(small_model), backend="neuron", instance="trn1.32xlarge", kv_cache_dtype="f8e4m3")
    with pytest.raises(ValueError, match=r"kv_cache_dtype \('f8e4m3'\): the neuron backend's compiled graphs keep the "
                                         r"KV cache in the compute dtype.*drop --kv-cache-dtype, or run eager"):
        plan_launch(LaunchConfig(**options), Progress(False))
    plan_launch(LaunchConfig(**options, compile=False), Progress(False))  # eager: the cache is fp8 there


def test_a_backend_whose_compiled_model_cannot_serve_refuses_compiling_before_ray(small_model):
    """Every command runs the serving engine, and the Neuron compiled model traces the static batch's
    shapes only (no serve_step, a cache without nbytes): each launch compiled every bucket with
    neuronx-cc, then failed its first rank's serving set-up."""
    options = dict(model=str(small_model), backend="neuron", instance="trn1.32xlarge")
    why = (r"^the neuron backend's compiled graphs cover the static batch's shapes only, and every command "
           r"runs the serving engine, whose steps they lack \(the launch failed after compiling every graph\)")
    with pytest.raises(ValueError, match=why + "; pass --no-compile \\(eager\\)$"):
        plan_launch(LaunchConfig(**options), Progress(False))
    with pytest.raises(ValueError, match=why + "; a neuron compiled directory cannot be built yet"):
        plan_launch(LaunchConfig(**options), Progress(False), into_out=True)
    assert plan_launch(LaunchConfig(**options, compile=False), Progress(False)).backend == "neuron"
