"""A quantized checkpoint planned at its 1-byte dtype on Neuron: the plan counts its other tensors
and KV cache in bfloat16 (NxD Inference's way), while the checkpoint keeps the float32 it was
quantized from, which a launch holds unless given --dtype bfloat16. The plan said nothing of it,
so the launch held twice the bytes the plan counted for those tensors."""

from __future__ import annotations

import pytest

from shardlib.model_config import load_model_config
from shardlib.planner import plan
from shardlib.quantize_checkpoint import quantize_checkpoint
from tests.model_factory import save_random_model
from tests.test_plan_cli import plan_in_process


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    original = save_random_model(root / "m", "llama", hidden_size=64, intermediate_size=96, num_heads=4,
                                 num_kv_heads=2, vocab_size=128)
    return quantize_checkpoint(original, root / "q8", "int8")


def _launch_dtype_warnings(warnings) -> list[str]:
    return [w for w in warnings if "--dtype bfloat16" in w]


def test_a_quantized_float32_checkpoint_planned_at_int8_on_neuron_names_the_launch_dtype(quantized_dir):
    config = load_model_config(quantized_dir)
    assert config.quantization is not None and config.torch_dtype == "float32"
    on_neuron = plan(config, instance="inf2.xlarge", tp=1, dtype="int8")
    [warning] = _launch_dtype_warnings(on_neuron.warnings)
    assert "bfloat16" in warning and "float32" in warning and "launch it with --dtype bfloat16" in warning, warning
    # where the plan counts what a launch holds, nothing to say: cpu keeps the checkpoint's float32,
    # and a float --dtype is the compute dtype as given
    assert _launch_dtype_warnings(plan(config, instance="cpu", tp=1, dtype="int8").warnings) == []
    for dtype in (None, "bfloat16", "float32"):
        assert _launch_dtype_warnings(plan(config, instance="inf2.xlarge", tp=1, dtype=dtype).warnings) == [], dtype


def test_corelaunch_plan_prints_the_warning(quantized_dir, capsys):
    result = plan_in_process(capsys, "--model", str(quantized_dir), "--instance", "inf2.xlarge", "--tp", "1",
                             "--dtype", "int8")
    assert result.returncode == 0, result
    [line] = [line for line in result.stdout.splitlines() if line.startswith("warning:") and "--dtype bfloat16" in line]
    assert "int8 plans this quantized checkpoint's other tensors and KV cache in bfloat16" in line, line
