"""`corelaunch plan` end to end: `python -m launcher plan ...` in a subprocess, as a user runs it
(exit codes and stdout as the shell sees them), and its parsing and refusals through main() in this
process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "configs"
QWEN = str(CONFIGS / "qwen2.5-72b.json")
SMOLLM2 = str(CONFIGS / "smollm2-135m-instruct.json")


def corelaunch_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def plan_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`corelaunch plan ARGS` through main() in this process, reported like corelaunch_plan's
    (a usage error's SystemExit becomes its exit code)."""
    capsys.readouterr()
    try:
        code = main(["plan", *args])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["corelaunch", "plan", *args], code, out.out, out.err)


def test_refused_layout_json_exits_2_with_every_error_code():
    out = corelaunch_plan("--model", QWEN, "--instance", "trn1.32xlarge", "--tp", "6", "--json")
    assert out.returncode == 2, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1  # exactly one JSON object
    result = json.loads(out.stdout)
    assert result["valid"] is False and result["tp_degree"] == 6
    assert {e["code"] for e in result["errors"]} == {"heads_not_divisible", "unsupported_tp_degree",
                                                    "insufficient_memory"}
    assert result["valid_tp_degrees"] == [16, 32]


def test_valid_layout_exits_0():
    out = corelaunch_plan("--model", SMOLLM2, "--tp", "3", "--dtype", "bfloat16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["valid"] is True and result["errors"] == []
    assert (result["tp_degree"], result["kv_strategy"], result["q_heads_per_rank"]) == (3, "shard", 3)
    assert result["instance"] == "cpu"


def test_readable_report_shows_each_error_with_its_code(capsys):
    out = plan_in_process(capsys, "--model", QWEN, "--instance", "trn1.32xlarge", "--tp", "6")
    assert out.returncode == 2
    assert out.stdout.startswith("INVALID")
    assert ("error [heads_not_divisible]: num_attention_heads (64) is not divisible by tp_degree (6); "
            "degrees that work for this model on trn1.32xlarge: 16, 32") in out.stdout
    assert "error [unsupported_tp_degree]" in out.stdout
    assert "valid tp degrees: 16, 32" in out.stdout


def test_the_readable_report_names_8_bit_weights_and_a_kv_cache_in_another_dtype(capsys, tmp_path):
    """A plan of an int8 checkpoint, or with an fp8 KV cache, read as a float32 one's: the bytes
    were counted, but the first line said only "float32"."""
    config = json.loads(Path(SMOLLM2).read_text())
    config["quantization_config"] = {"quant_method": "corelaunch", "quantization_dtype": "int8",
                                     "quantization_type": "per_channel_symmetric", "modules": "linear"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    first = {args: plan_in_process(capsys, *args).stdout.splitlines()[0]
             for args in (("--model", str(tmp_path)), ("--model", str(tmp_path), "--kv-cache-dtype", "f8e4m3"),
                          ("--model", SMOLLM2, "--kv-cache-dtype", "f8e4m3"), ("--model", SMOLLM2, "--dtype", "float32"))}
    said = [line.split("), ", 1)[1].split(", batch_size")[0] for line in first.values()]
    assert said == ["bfloat16, int8 weights", "bfloat16, int8 weights, KV cache float8_e4m3",  # the config's dtype
                    "bfloat16, KV cache float8_e4m3", "float32"], first


def test_flags_reach_the_planner(capsys):
    out = plan_in_process(capsys, "--model", str(CONFIGS / "llama-3.1-405b.json"), "--instance", "trn2.48xlarge",
                          "--tp", "128", "--nodes", "2", "--batch-size", "2", "--seq-len", "1024", "--json")
    assert out.returncode == 0, out.stdout
    result = json.loads(out.stdout)
    assert (result["nodes"], result["lnc"], result["ranks_per_node"]) == (2, 2, 64)
    assert (result["batch_size"], result["seq_len"]) == (2, 1024)
    lnc = plan_in_process(capsys, "--model", SMOLLM2, "--instance", "trn1.32xlarge", "--lnc", "2", "--tp", "1",
                          "--json")
    assert lnc.returncode == 2 and [e["code"] for e in json.loads(lnc.stdout)["errors"]] == ["invalid_lnc"]
    kv = plan_in_process(capsys, "--model", SMOLLM2, "--tp", "9", "--kv-strategy", "shard")
    assert kv.returncode == 2 and "error [kv_heads_incompatible]" in kv.stdout


def test_missing_model_path_exits_2_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    out = corelaunch_plan("--model", str(missing))
    assert out.returncode == 2 and out.stdout == ""
    assert str(missing) in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_unknown_architecture_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    out = plan_in_process(capsys, "--model", str(tmp_path))
    assert out.returncode == 2 and out.stdout == ""
    assert "model_type='gpt2'" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_unplannable_input_with_json_still_prints_one_json_object(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    out = plan_in_process(capsys, "--model", str(missing), "--json")
    assert out.returncode == 2 and str(missing) in out.stderr
    result = json.loads(out.stdout)
    assert result["valid"] is False and [e["code"] for e in result["errors"]] == ["unplannable"]
    assert str(missing) in result["errors"][0]["message"]


def test_seq_len_below_two_is_refused_as_generate_refuses_it(capsys):
    out = plan_in_process(capsys, "--model", SMOLLM2, "--seq-len", "1", "--json")
    assert out.returncode == 2
    assert "--seq-len (1) must be at least 2" in json.loads(out.stdout)["errors"][0]["message"]
    assert plan_in_process(capsys, "--model", SMOLLM2, "--seq-len", "2").returncode == 0


def test_bad_tp_value_is_a_usage_error(capsys):
    out = plan_in_process(capsys, "--model", SMOLLM2, "--tp", "three")
    assert out.returncode == 2 and "--tp must be a positive integer or 'auto'" in out.stderr
    assert out.stdout == ""  # no --json: stdout stays empty
    # one line naming --help, as every other command's refusal (the whole usage block came first)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("corelaunch plan: error: argument --tp")
    assert out.stderr.rstrip().endswith("(see `corelaunch plan --help`)")


def test_usage_errors_with_json_print_one_json_object_too(capsys):
    for args, words in ((("--tp", "0"), "--tp must be a positive integer or 'auto', not '0'"),
                        (("--seq-len", "abc"), "argument --seq-len: invalid int value: 'abc'"),
                        (("--instance", "trn9"), "argument --instance: invalid choice: 'trn9'"),
                        (("--max-num-seqs", "-1"), "--max-num-seqs (-1) must be at least 0")):
        out = plan_in_process(capsys, "--model", SMOLLM2, "--json", *args)
        assert out.returncode == 2 and words in out.stderr, args
        result = json.loads(out.stdout)  # was empty: argparse exited before run()
        assert result["valid"] is False and result["errors"][0]["code"] == "unplannable"
        assert words in result["errors"][0]["message"], args


@pytest.mark.parametrize("args, words", [
    (("--json", "--foo"), "unrecognized arguments: --foo"),  # an unknown option
    (("--json", "--instanse", "cpu"), "unrecognized arguments: --instanse cpu"),  # a typo of one
    (("--json", "extra"), "unrecognized arguments: extra"),  # an extra positional
    (("--js", "--tp", "0"), "--tp must be a positive integer or 'auto', not '0'"),  # --json abbreviated
    (("--js", "--foo"), "unrecognized arguments: --foo"),
])
def test_every_usage_error_with_json_prints_strict_json_on_stdout(args, words):
    """Unknown arguments went to the dispatcher's own refusal, not plan's: stdout was empty, as it
    was for any refusal after --json abbreviated (argparse takes `--js` as --json)."""
    out = corelaunch_plan("--model", SMOLLM2, *args)
    assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
    assert len(out.stdout.splitlines()) == 1, (args, out.stdout)  # one object, nothing else on stdout
    result = json.loads(out.stdout)
    assert result == {"valid": False, "errors": [{"code": "unplannable", "message": result["errors"][0]["message"]}]}
    assert words in result["errors"][0]["message"], args


def test_an_unknown_argument_without_json_leaves_stdout_empty(capsys):
    out = plan_in_process(capsys, "--model", SMOLLM2, "--foo")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "corelaunch plan: error: unrecognized arguments: --foo (see `corelaunch plan --help`)\n"


def test_a_reader_that_left_is_not_a_traceback():
    """`corelaunch plan | head -1`: the pipe's reader gone before the report is written. Python
    buffers stdout into a pipe (unless PYTHONUNBUFFERED is set, as it may be here: both ways are
    run), so the failing write can come at the end, not at the print."""
    import os

    for unbuffered in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
        read, write = os.pipe()
        os.close(read)
        try:
            proc = subprocess.run([sys.executable, "-c", "from launcher.cli import run; run()", "plan", "--model",
                                   SMOLLM2], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                                  env=env)
        finally:
            os.close(write)
        assert proc.returncode == 141 and proc.stderr == "", (unbuffered, proc.returncode, proc.stderr)


BENCH_TABLE_TO_A_GONE_READER = """
import sys
import launcher.cli.bench_command as bench
from shardlib.evaluation.bench_report import PERCENTILES, SECTIONS
section = {**{f"latency_ms_p{p}": 1.0 for p in PERCENTILES}, "latency_ms_avg": 1.0, "throughput": 1.0,
           "throughput_unit": "tokens/s", "count": 1}
config = {"tp_degree": 1, "backend": "cpu", "dtype": "float32", "batch_size": 1, "prompt_len": 8,
          "max_new_tokens": 2, "runs": 1, "warmup": 0}
bench._bench = lambda args: {**{name: section for name in SECTIONS}, "config": config}
sys.argv = ["corelaunch", "bench"]
from launcher.cli import run
run()
"""


def test_benchs_table_to_a_reader_that_left_exits_as_every_command_does():
    """bench prints its table through rich, which caught the broken pipe itself and exited 1."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-c", BENCH_TABLE_TO_A_GONE_READER], cwd=REPO, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_default_model_is_the_demo_model(tmp_path, monkeypatch, capsys):
    """Without --model the command plans shardlib.demo_model's folder (stubbed: no conversion here)."""
    import shardlib.demo_model

    shutil.copy(SMOLLM2, tmp_path / "config.json")
    monkeypatch.setattr(shardlib.demo_model, "ensure_demo_model", lambda: tmp_path)
    assert main(["plan", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["num_attention_heads"] == 9 and result["valid_tp_degrees"] == [1, 3, 9]


def test_model_directory_works_like_its_config_file(tmp_path, capsys):
    shutil.copy(SMOLLM2, tmp_path / "config.json")
    out = plan_in_process(capsys, "--model", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["num_attention_heads"] == 9


LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_the_serving_rows_a_launch_holds_are_planned_too(capsys, tmp_path):
    """generate and serve hold max_num_seqs + 1 KV cache rows beside the batch; plan counted the
    batch alone, so it said VALID for a layout a launch then refused."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ("--model", str(tmp_path), "--instance", "inf2.xlarge", "--tp", "2", "--seq-len", "16384")
    default = plan_in_process(capsys, *args)  # generate's 8 slots: 1 + 9 rows of 16384 positions
    assert default.returncode == 2 and "batch_size 1 + 9 serving rows" in default.stdout
    assert "fewer serving rows (--max-num-seqs at most 4 at batch_size 1)" in default.stdout
    # the header names the rows its memory figures count (it said "batch_size 1" above 10 rows' KV cache)
    assert default.stdout.splitlines()[0].endswith("bfloat16, batch_size 1 + 9 serving rows, seq_len 16384")
    assert plan_in_process(capsys, *args, "--max-num-seqs", "4").returncode == 0
    assert plan_in_process(capsys, *args, "--max-num-seqs", "5").returncode == 2
    assert plan_in_process(capsys, *args, "--max-num-seqs", "0").returncode == 0  # a static batch alone
    refused = plan_in_process(capsys, *args, "--max-num-seqs", "-1")
    assert refused.returncode == 2 and "--max-num-seqs (-1) must be at least 0" in refused.stderr


@pytest.mark.parametrize("flag, field", [("--batch-size", "batch_size"), ("--nodes", "nodes"),
                                         ("--seq-len", "seq_len")])
def test_a_refused_option_is_named_by_its_flag(capsys, flag, field):
    """plan's refusals named the planner's parameter (`batch_size (0) must be ...`) where every
    other command names the option. (--batch-size 0 alone plans the serving rows alone: see
    tests/test_no_static_rows.py.)"""
    if flag == "--batch-size":  # 0 is taken beside serving rows: no static batch
        out = plan_in_process(capsys, "--model", SMOLLM2, flag, "-1")
        assert out.returncode == 2
        assert out.stderr.strip() == (f"corelaunch plan: {flag} (-1) must be a positive integer, or 0 for no static "
                                      f"batch (the serving rows alone)")
        return
    out = plan_in_process(capsys, "--model", SMOLLM2, flag, "0")
    assert out.returncode == 2
    assert out.stderr.strip() == f"corelaunch plan: {flag} (0) must be a positive integer"


MIXTRAL = CONFIGS / "mixtral-8x7b-v0.1.json"
MIXTRAL_IGNORED = ("num_local_experts (8) is ignored for a mistral model, as transformers ignores it; if these "
                   "are Mixtral weights, set model_type to mixtral")


def test_a_mixtral_config_saved_as_mistral_plans_dense_with_a_warning(capsys, tmp_path):
    """It planned silently as a dense 7B model (46.7B as mixtral): transformers reads it dense too, so
    the plan stays dense, but says the expert count it ignored and how to run the experts."""
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(MIXTRAL.read_text()), "model_type": "mistral"}))
    out = plan_in_process(capsys, "--model", str(tmp_path), "--instance", "trn1.32xlarge", "--tp", "8")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("VALID: mistral (32 heads, 8 KV heads, 7.24 B params)"), lines[0]
    assert f"warning: {MIXTRAL_IGNORED}" in lines, out.stdout
    as_json = plan_in_process(capsys, "--model", str(tmp_path / "config.json"), "--instance", "trn1.32xlarge",
                              "--tp", "8", "--json")
    result = json.loads(as_json.stdout)  # still one JSON object on stdout
    assert result["warnings"] == [MIXTRAL_IGNORED] and result["model"]["num_local_experts"] == 0
    # the real Mixtral, and a dense config without an expert count, say nothing of it
    for config in (MIXTRAL, CONFIGS / "llama-3.1-8b.json"):
        quiet = plan_in_process(capsys, "--model", str(config), "--instance", "trn1.32xlarge", "--tp", "8")
        assert "is ignored for a" not in quiet.stdout, quiet.stdout


def test_a_qwen3_moe_config_saved_as_qwen3_names_qwen3_moe(capsys, tmp_path):
    raw = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 16, "intermediate_size": 200,
           "num_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = json.loads(plan_in_process(capsys, "--model", str(tmp_path), "--tp", "2", "--json").stdout)
    assert result["warnings"] == ["num_experts (4) is ignored for a qwen3 model, as transformers ignores it; if "
                                  "these are Qwen3-MoE weights, set model_type to qwen3_moe"]


def test_a_mixtral_config_with_layer_types_warns_that_every_layer_slides(capsys, tmp_path):
    raw = {**json.loads(MIXTRAL.read_text()), "sliding_window": 4096,
           "layer_types": ["full_attention", "sliding_attention"] * 16}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = json.loads(plan_in_process(capsys, "--model", str(tmp_path), "--instance", "trn1.32xlarge", "--tp",
                                        "8", "--json").stdout)
    assert result["warnings"] == ["layer_types is ignored for a mixtral model, as transformers ignores it: the "
                                  "sliding window, where the config sets one, applies to every layer"]
