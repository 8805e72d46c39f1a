"""The first line of `corelaunch plan`'s report says one plan one way: an int8 checkpoint, the same
checkpoint with `--dtype int8`, and its unquantized original with `--dtype int8` (the checkpoint
`corelaunch quantize` would write) plan the same bytes and read "float32, int8 weights" alike, the
compute dtype first. They read "float32, int8 weights", "int8, int8 weights, KV cache float32" and
"int8, KV cache float32": a 1-byte --dtype was shown as the compute dtype, and the KV cache, in the
compute dtype, as another one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_plan_cli import SMOLLM2, plan_in_process

QUANTIZATION = {"quant_method": "corelaunch", "quantization_dtype": "int8",
                "quantization_type": "per_channel_symmetric", "modules": "linear"}


@pytest.fixture
def models(tmp_path) -> tuple[str, str]:
    """(a float32 SmolLM2 config, the config `corelaunch quantize --dtype int8` writes for it)."""
    config = {**json.loads(Path(SMOLLM2).read_text()), "torch_dtype": "float32"}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return str(tmp_path / "src"), str(tmp_path / "q")


def _ways(models) -> list[tuple[str, ...]]:
    src, q = models
    return [("--model", src, "--dtype", "int8"), ("--model", q), ("--model", q, "--dtype", "int8")]


def _dtypes(line: str) -> str:
    """The dtype words of a report's first line ("float32, int8 weights, KV cache ...")."""
    return line.split("), ", 1)[1].split(", batch_size")[0]


@pytest.mark.parametrize("instance, extra, said", [
    ("cpu", (), "float32, int8 weights"),
    ("cpu", ("--kv-cache-dtype", "f8e4m3"), "float32, int8 weights, KV cache float8_e4m3"),
])
def test_three_ways_to_plan_int8_weights_read_alike(capsys, models, instance, extra, said):
    reports = [plan_in_process(capsys, *way, "--instance", instance, *extra) for way in _ways(models)]
    assert [r.returncode for r in reports] == [0, 0, 0], [r.stderr for r in reports]
    firsts = [r.stdout.splitlines()[0] for r in reports]
    assert [_dtypes(line) for line in firsts] == [said] * 3, firsts
    assert len(set(firsts)) == 1, firsts
    assert len({r.stdout.splitlines()[2] for r in reports}) == 1  # the memory line: the same bytes


def test_a_1_byte_dtype_on_neuron_reads_bfloat16_compute(capsys, models):
    """On Neuron a 1-byte --dtype runs the other tensors and the KV cache in bfloat16 (NxD's way)."""
    src, q = models
    firsts = [plan_in_process(capsys, "--model", model, "--dtype", "int8", "--instance", "trn1.32xlarge",
                              "--tp", "1").stdout.splitlines()[0] for model in (src, q)]
    assert [_dtypes(line) for line in firsts] == ["bfloat16, int8 weights"] * 2, firsts


def test_json_dtype_fields_are_unchanged(capsys, models):
    """--json keeps reporting the dtype asked for (its fields did not change)."""
    src, q = models
    report = json.loads(plan_in_process(capsys, "--model", src, "--dtype", "int8", "--json").stdout)
    assert (report["dtype"], report["memory"]["kv_cache_dtype"]) == ("int8", "float32")
    report = json.loads(plan_in_process(capsys, "--model", q, "--json").stdout)
    assert (report["dtype"], report["memory"]["kv_cache_dtype"]) == ("float32", "float32")


def test_quantizes_spellings_of_the_8_bit_formats_plan_as_the_planners(capsys, models):
    """`plan --dtype f8e4m3` was refused as an unknown dtype, though quantize, --kv-cache-dtype and
    the report's own first line ("f8e4m3 weights") spell it so."""
    src, _ = models
    for alias, name in (("f8e4m3", "float8_e4m3"), ("FP8_E5M2", "float8_e5m2")):
        said, named = (plan_in_process(capsys, "--model", src, "--dtype", d) for d in (alias, name))
        assert said.returncode == 0, said.stderr
        assert said.stdout == named.stdout
