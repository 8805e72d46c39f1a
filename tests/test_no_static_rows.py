"""Launches that run continuous batching alone (`corelaunch serve`, `corelaunch generate`) plan no
static rows: they planned batch_size = max_batch_size (8) static KV rows of seq_len beside the serving
rows, which they never allocate, and were refused for memory they did not need (8 rows of an 8B model
at 8192 tokens are 8 GiB of a Neuron core pair's 16). LaunchConfig.max_batch_size 0 says so; a static
generate() is then refused at the call."""

from __future__ import annotations

import argparse
import json

import pytest

from shardlib.model_config import load_model_config
from shardlib.planner import plan as make_plan

INSTANCE = "trn1.2xlarge"
"""A fixed planner target (16 GiB per NeuronCore at LNC 1), so the limits do not depend on this host's RAM."""

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
         "intermediate_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
         "max_position_embeddings": 32768, "vocab_size": 32000, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "tie_word_embeddings": False}
"""0.33 B parameters, 0.5 GiB of bfloat16 KV cache per row of 8192 positions at TP 1."""


@pytest.fixture
def config_only(tmp_path, monkeypatch):
    """A model directory of config.json alone, as `corelaunch plan` takes one; the checkpoint check
    that follows the plan in plan_launch is the only step that reads weights, and is skipped."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    monkeypatch.setattr("shardlib.checkpoint_files.check_checkpoint", lambda *args, **kwargs: None)
    return tmp_path


def _rows_matter(model_dir, serving_rows: int, seq_len: int) -> None:
    """The case is one where the static rows decide: with them the layout is refused, without them taken."""
    config = load_model_config(model_dir)
    static = make_plan(config, instance=INSTANCE, tp=1, batch_size=8, serving_rows=serving_rows, seq_len=seq_len)
    alone = make_plan(config, instance=INSTANCE, tp=1, batch_size=0, serving_rows=serving_rows, seq_len=seq_len)
    assert not static.valid and alone.valid


def test_serve_plans_the_serving_rows_alone(config_only, ray_tripwire):
    """`corelaunch serve --seq-len 12288` (16 sequences: 17 rows) was refused: 8 static rows + 17."""
    from launcher.cli.serve_command import _plan
    from launcher.serving.server_settings import settings_from_args

    settings = settings_from_args({"model": str(config_only), "backend": "cpu", "instance": INSTANCE, "tp": 1,
                                   "seq_len": 12288, "max_num_seqs": 16})
    assert _plan(settings) == config_only  # planned as each Serve replica plans, and taken
    assert settings.launch["max_batch_size"] == 0
    _rows_matter(config_only, 17, 12288)


def test_a_serve_config_cannot_ask_for_static_rows():
    from launcher.serving.server_settings import settings_from_args

    with pytest.raises(ValueError, match=r"^max_batch_size \(8\) does not apply to a server: a server runs "
                                         r"continuous batching alone, never a static batch"):
        settings_from_args({"max_batch_size": 8})


def test_generate_plans_the_serving_rows_alone(config_only, ray_tripwire):
    """`corelaunch generate --seq-len 16384` (8 sequences: 9 rows) was refused: 8 static rows + 9."""
    from launcher.cli import generate_command
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress

    parser = argparse.ArgumentParser()
    generate_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", str(config_only), "--backend", "cpu", "--instance", INSTANCE,
                              "--tp", "1", "--seq-len", "16384", "x"])
    planned = plan_launch(generate_command.launch_config(args), Progress(False))  # as Launcher.prepare plans
    assert (planned.plan.batch_size, planned.plan.serving_rows) == (0, 9)
    _rows_matter(config_only, 9, 16384)


def test_generate_takes_no_max_batch_size_flag(capsys):
    """Its only role was sizing the memory check for static rows generate never runs."""
    from launcher.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--max-batch-size", "4", "x"])
    assert exit_.value.code == 2 and "unrecognized arguments: --max-batch-size 4 (see" in capsys.readouterr().err


def test_a_static_generate_is_refused_without_static_rows(ray_tripwire):
    """The plan counted no rows for it: refused at the call (before any start), naming the fix."""
    from launcher.api import LaunchConfig, Launcher

    config = LaunchConfig(max_batch_size=0, warm_up=True, compile=True)
    assert config.warm_up_static is False  # no static graph to build
    launcher = Launcher(config)
    said = (r"batching='static' runs batches of at most max_batch_size prompts, and this launch's max_batch_size "
            r"is 0 \(no static batches.*launch with max_batch_size 1 or more")
    with pytest.raises(ValueError, match=said):
        launcher.generate(["hi"], batching="static")
    with pytest.raises(ValueError, match=said):
        launcher.check_prompts(["hi"], batching="static")
    with pytest.raises(ValueError, match=r"max_batch_size \(-1\) must be an integer >= 0"):
        LaunchConfig(max_batch_size=-1)


def test_the_buckets_of_a_launch_without_static_rows_are_built():
    """launch_buckets makes batch buckets up to max_batch_size and needs one: 0 is built as 1."""
    from types import SimpleNamespace

    from launcher.api import LaunchConfig
    from launcher.artifacts.compiled_dir import load_spec_fields

    config = LaunchConfig(max_batch_size=0, compile=True, warm_up=True)
    fields = load_spec_fields(config, SimpleNamespace(seq_len=256),
                              SimpleNamespace(max_position_embeddings=256))
    assert fields["buckets"].batch == (1,) and fields["warm_up"] is False and config.max_batch_size == 0


def test_the_planner_names_the_serving_rows_alone_at_batch_size_0(config_only):
    config = load_model_config(config_only)
    refused = make_plan(config, instance=INSTANCE, tp=1, batch_size=0, serving_rows=17, seq_len=16384)
    text = " ".join(e.message for e in refused.errors)
    assert not refused.valid and "(17 serving rows, seq_len 16384" in text, text
    assert "batch_size" not in text, text  # no "batch_size 0 +", no "a smaller batch_size"
    assert "a smaller seq_len (at most 13278 at 17 serving rows)" in text, text
    assert "fewer serving rows (--max-num-seqs at most 12)" in text, text
    with pytest.raises(ValueError, match=r"^batch_size \(0\) plans no static batch, and there are no serving rows"):
        make_plan(config, instance=INSTANCE, batch_size=0, serving_rows=0)


def test_plan_batch_size_0_plans_what_serve_plans(config_only, capsys):
    from launcher.cli import main

    assert main(["plan", "--model", str(config_only), "--instance", INSTANCE, "--tp", "1", "--seq-len", "12288",
                 "--max-num-seqs", "16", "--batch-size", "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("VALID") and first.endswith("bfloat16, 17 serving rows, seq_len 12288"), first
    assert main(["plan", "--model", str(config_only), "--batch-size", "0", "--max-num-seqs", "0"]) == 2
    assert "corelaunch plan: --batch-size (0) plans no static batch" in capsys.readouterr().err


def test_the_one_byte_way_out_is_the_quantize_step(config_only):
    """generate's and serve's --dtype take float32, bfloat16 and float16 alone: "a lower-precision
    dtype: float8_e4m3" named a value they refuse; 1-byte weights are a checkpoint quantize writes."""
    config = load_model_config(config_only)
    text = " ".join(e.message for e in make_plan(config, instance=INSTANCE, tp=1, batch_size=1, serving_rows=17,
                                                  seq_len=16384).errors)
    assert ("1-byte weights: float8_e4m3 fits at tp 2; write them with `corelaunch quantize --dtype f8e4m3 --out "
            "QDIR` and launch QDIR (--model QDIR)") in text, text
    assert "a lower-precision dtype: float8_e4m3" not in text
    wide = dict(LLAMA, torch_dtype="float32")
    (config_only / "config.json").write_text(json.dumps(wide))
    text = " ".join(e.message for e in make_plan(load_model_config(config_only), instance=INSTANCE, tp=1,
                                                  batch_size=1, serving_rows=17, seq_len=16384).errors)
    assert "a lower-precision dtype: bfloat16 fits at tp" in text, text  # a 2-byte dtype stays a --dtype
