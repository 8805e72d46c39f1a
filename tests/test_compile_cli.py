"""`corelaunch compile` and `corelaunch generate --compiled`: the directory, its reload without
recompiling (inductor cache counters), and refusals naming what differs.

The model is a tiny random Llama with a word-level tokenizer ("t0" .. "t127"), so the CLI's text
prompts work without downloading anything. The compile-then-generate test is also the suite's check
that a persisted inductor cache is reused by a fresh process (it replaced tests/test_compiled_cache.py,
which did the same with one RankWorker per process and no Ray).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.api import LaunchConfig
from launcher.artifacts import compiled_dir
from tests.model_factory import build_random_model, save_model
from workers.compiled import library_versions

REPO = Path(__file__).resolve().parents[1]
VOCAB = 128
LAYERS = 1
"""One decoder layer: each graph compiles in about half a two-layer model's time (the compile
test's four graphs took 32 s against 16 s alone on 2 cores), and a graph is the same per layer."""


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over "t0" .. "t127" (ids 0 .. 127), saved as Hugging Face files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0",
                            eos_token="t2").save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = save_model(build_random_model("llama", seed=3, vocab_size=VOCAB, num_layers=LAYERS),
                      tmp_path_factory.mktemp("tiny"))
    save_word_tokenizer(path)
    return path


def corelaunch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


PROMPT = "t5 t9 t33 t17 t80"


def eager_tokens(model_dir: Path, prompt: str, new_tokens: int) -> list[int]:
    """Greedy tokens of the prompt from the eager model in this process (the reference)."""
    from transformers import AutoTokenizer

    from shardlib.model_config import load_model_config
    from tests.tp_harness import build_rank_model, hf_state_dict
    from workers.collectives import SingleRank
    from workers.engine import generate
    from workers.sampling import SamplingParams

    ids = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    model = build_rank_model(load_model_config(model_dir), hf_state_dict(build_random_model(
        "llama", seed=3, vocab_size=VOCAB, num_layers=LAYERS)), 0, 1, SingleRank())
    return generate(model, [ids], [SamplingParams()], new_tokens, [])[0].token_ids


@pytest.mark.slow
def test_compile_then_generate_from_the_directory_reuses_every_graph(model_dir, tmp_path, ray_address):
    """Two fresh processes, as a restarted deployment would be: the first compiles every graph into
    the directory's empty inductor cache, the second finds them all there and compiles nothing.
    Both join the session's Ray: each rank points its inductor cache into the directory itself."""
    out = tmp_path / "compiled"
    # --max-num-seqs 1: serving graphs for batch bucket 1 only (each bucket costs a compile);
    # --max-prefill-tokens 8: prompts prefilled in chunks of 8, starting a sequence or continuing it
    built = corelaunch("compile", "--model", str(model_dir), "--tp", "1", "--buckets", "16", "--max-num-seqs", "1",
                       "--max-prefill-tokens", "8", "--ray-address", ray_address, "--json", "--out", str(out))
    assert built.returncode == 0, built.stderr
    manifest = json.loads(built.stdout)
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["buckets"] == {"context": [16], "token": [16], "batch": [1]}
    assert manifest["tp_degree"] == 1 and manifest["dtype"] == "float32" and manifest["backend"] == "cpu"
    assert manifest["max_num_seqs"] == 1 and manifest["max_prefill_tokens"] == 8
    assert manifest["fused_projections"] is False
    # what the CPU kernels were built for: the session cluster's CPUs over the one rank, whole
    assert isinstance(manifest["threads_per_rank"], int) and manifest["threads_per_rank"] >= 1
    assert {k: manifest["versions"][k] for k in ("torch", "transformers", "corelaunch")} == \
        {k: library_versions()[k] for k in ("torch", "transformers", "corelaunch")}
    # the serving graphs too: they were left out of the manifest, its compile stats and the progress,
    # though with default settings they are most of the work; not the prefill chunks continuing a
    # sequence, which the cpu backend runs eagerly
    assert [(g["phase"], g["batch"], g["length"]) for g in manifest["graphs"]] == [
        ("context", 1, 16), ("token", 1, 16), ("serve-prefill-start", 1, 8), ("serve-decode", 1, 16)]
    assert "graph 2/2: token-generation batch 1 x 16" in built.stderr  # progress on stderr
    assert "then 2 serving graph(s)" in built.stderr and "  2 serving graph(s) (" in built.stderr
    # each serving graph as it is built, as the static ones (only their total was shown)
    for line in ("  serving graph 1/2: prefill chunk (starting a sequence) batch 1 x 8 (",
                 "  serving graph 2/2: decode step batch 1 x 16 ("):
        assert line in built.stderr, built.stderr
    assert (out / "weights" / "manifest.json").is_file() and (out / "model" / "tokenizer.json").is_file()
    cold = manifest["compile_stats"]
    assert cold["fxgraph_cache_miss"] > 0 and cold["autograd_cache_miss"] > 0  # it really compiled

    # no --max-num-seqs: the directory's 1 (generate's own 8 rebuilt every serving graph); no
    # --max-prefill-tokens (generate has none): the directory's 8 (2048 built a prefill of 16)
    warm = corelaunch("generate", "--compiled", str(out), "--warm-up", "--max-new-tokens", "6",
                      "--ray-address", ray_address, "--json", "--quiet", PROMPT)
    assert warm.returncode == 0, warm.stderr
    report = json.loads(warm.stdout)
    assert report["outputs"][0]["token_ids"] == eager_tokens(model_dir, PROMPT, 6)
    assert report["model"] == str(out / "model")  # not the hidden version the next compile deletes
    stats = report["compile"]
    # --warm-up set up the serving loop's graphs again, and the request needed no other: the prefill
    # chunk of 8 starting a sequence (the one continuing it runs eagerly) and the decode step at the
    # one batch bucket; not the static engine's, which generate never runs (its --warm-up built them
    # too, most of a default warm-up) ...
    assert sorted((g["phase"], g["batch"], g["length"]) for g in stats["graphs"]) == sorted(
        [("serve-prefill-start", 1, 8), ("serve-decode", 1, 16)])
    # ... both from the directory's cache: it compiled nothing
    assert stats["fxgraph_cache_miss"] == 0 and stats["autograd_cache_miss"] == 0
    assert stats["fxgraph_cache_hit"] > 0 and stats["autograd_cache_hit"] > 0


def fake_compiled_dir(root: Path, model_dir: Path, **overrides) -> Path:
    """A compiled-model directory's manifest and model files (an empty weights folder: refusals
    come first)."""
    from shardlib.model_config import load_model_config

    (root / "model").mkdir(parents=True)
    (root / "weights").mkdir()
    (root / "model" / "config.json").write_text((model_dir / "config.json").read_text())
    manifest = {"format_version": compiled_dir.FORMAT_VERSION,
                "config_hash": load_model_config(model_dir).config_hash(), "tp_degree": 1, "kv_strategy": "shard",
                "dtype": "float32", "backend": "cpu", "buckets": {"context": [8, 16], "token": [16], "batch": [1]},
                "versions": library_versions()}
    manifest.update(overrides)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_a_launch_at_another_thread_count_is_told_its_graphs_are_built_again(model_dir, tmp_path):
    """inductor's CPU kernels are generated for a thread count, part of their cache key: `serve
    --replicas 2` from a directory compiled for one replica (half the threads per rank) rebuilt
    every graph on its first requests, as if the directory held none."""
    from launcher.artifacts.compiled_dir import other_thread_count

    root = fake_compiled_dir(tmp_path / "c", model_dir, threads_per_rank=2)
    note = other_thread_count(root, "cpu", 1)
    assert note == (f"note: the compiled directory's graphs were compiled for 2 thread(s) per rank and this launch "
                    f"runs 1: inductor builds CPU kernels for a thread count, so each graph is built again when "
                    f"first used (and cached for later runs); compile with --cpus-per-rank 1 to match")
    assert other_thread_count(root, "cpu", 2) is None and other_thread_count(root, "cuda", 1) is None
    older = fake_compiled_dir(tmp_path / "old", model_dir)  # compiled before the count was recorded
    assert other_thread_count(older, "cpu", 1) is None


@pytest.mark.parametrize("asked, overrides, expected, in_the_api", [
    (dict(tp=2), {}, r"--tp: expected 1 \(compiled\), found 2 \(asked\)", "tp: expected 1 (compiled), found 2"),
    (dict(dtype="bfloat16"), {}, r"--dtype: expected 'float32' \(compiled\), found 'bfloat16' \(asked\)",
     "dtype: expected 'float32'"),
    (dict(token_buckets=(16, 32)), {}, r"--token-buckets: expected \[16\] \(compiled\), found \[16, 32\]",
     "token_buckets: expected [16]"),
    (dict(compile=False), {}, r"--no-compile: a compiled directory runs compiled",
     "compile: False: a compiled directory runs compiled"),
    # was "expected None": a Python value, where the directory simply has no 8-bit cache
    (dict(kv_cache_dtype="f8e4m3"), {}, r"--kv-cache-dtype: expected none \(compiled\), found 'f8e4m3' \(asked\)",
     "kv_cache_dtype: expected none"),
    # the buckets set seq_len (16 -> 8): named once, as the buckets, not as a --seq-len nobody gave
    (dict(token_buckets=(8,)), {},
     r"--token-buckets: expected \[16\] \(compiled\), found \[8\] \(asked\)\. Re-run", "token_buckets: expected [16]"),
    (dict(lnc=1), {"lnc": 2}, r"--lnc: expected 2 \(compiled\), found 1 \(asked\)", "lnc: expected 2"),
    # each was dropped silently: the directory's own weights and buckets were used
    (dict(max_context_length=8), {}, r"--max-context-length: expected 16 \(compiled: the largest context bucket\), "
                                     r"found 8 \(asked\)", "max_context_length: expected 16"),
    (dict(presharded_dir="/"), {}, r"--presharded: expected none \(the directory's own weights, "
                                   r".*weights\), found / \(asked\)", "presharded_dir: expected none"),
    (dict(compile_granularity="model"), {"granularity": "layer"},
     r"--granularity: expected 'layer' \(compiled\), found 'model'", "compile_granularity: expected 'layer'"),
    # no option asks for a library version: labelled, and the fix is to install the one compiled with
    ({}, {"versions": {**library_versions(), "torch": "1.0.0"}},
     r"torch: expected '1.0.0' \(compiled\), found '.*' \(installed\)\. Re-run .*or install the library versions "
     r"it was compiled with$", "torch: expected '1.0.0'"),
    ({}, {"versions": {**library_versions(), "transformers": "4.0.0"}}, r"transformers: expected '4.0.0'",
     "transformers: expected '4.0.0'"),
])
def test_a_mismatch_is_refused_naming_the_field_and_the_fix(model_dir, tmp_path, asked, overrides, expected,
                                                           in_the_api):
    """The command line names each difference by its option; the driver API by LaunchConfig's field
    (it named the options there too: `--granularity` for compile_granularity)."""
    from launcher.cli.options import with_flag_name

    root = fake_compiled_dir(tmp_path / "c", model_dir, **overrides)
    with pytest.raises(ValueError) as err:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), **asked))
    assert re.search(expected, with_flag_name(err.value)), with_flag_name(err.value)
    assert f"does not match this launch: {in_the_api}" in str(err.value), err.value
    assert "--" not in str(err.value).split("Re-run")[0], err.value  # no option named in the driver API
    assert "Re-run `corelaunch compile`" in str(err.value)


def test_a_directory_of_another_kind_given_as_compiled_names_the_flag_that_takes_it(model_dir, tmp_path):
    """A Hugging Face model or a pre-sharded checkpoint given as --compiled was told to `compile
    --out` into itself, which refuses such a directory; a broken manifest behind a link named the
    hidden version it links to, and told to compile --out into that."""
    from shardlib.model_config import load_model_config
    from shardlib.presharded import save_presharded
    from shardlib.sharding import ShardLayout

    with pytest.raises(ValueError, match=rf"{model_dir} is a Hugging Face model, not a compiled-model directory: "
                                         rf"pass it as --model"):
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(model_dir)))
    config = load_model_config(model_dir)
    copy = save_presharded(tmp_path / "p", model_dir, config, ShardLayout.for_model(config, 1))
    with pytest.raises(ValueError, match=rf"{copy} is a pre-sharded checkpoint, not a compiled-model directory: "
                                         rf"pass it as --presharded"):
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(copy)))
    from shardlib.atomic_dir import refuse_foreign_dir  # what `compile --out` runs: it has no --presharded

    with pytest.raises(FileExistsError) as as_out:
        refuse_foreign_dir(copy, "a compiled-model directory", read_kind=compiled_dir.read_manifest)
    assert "--presharded" not in str(as_out.value), as_out.value
    version = fake_compiled_dir(tmp_path / ".c.v-host-1-aaaaaaaa", model_dir, granularity="bogus")
    link = tmp_path / "c"
    link.symlink_to(version.name)
    with pytest.raises(ValueError) as broken:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(link)))
    assert f"{link}/manifest.json: field 'granularity'" in str(broken.value), broken.value
    assert ".c.v-" not in str(broken.value) and f"--out {link}`" in str(broken.value), broken.value


@pytest.mark.parametrize("command", ["generate", "compile"])
def test_a_manifest_key_is_named_as_the_file_has_it_not_as_an_option(model_dir, tmp_path, command, capsys,
                                                                      ray_tripwire):
    """The refusal names the file and its key: the command's words for the planner's tp_degree
    (--tp) replaced the key too ("field '--tp' must be a positive integer", "lacks ..., --tp, ...")."""
    from launcher.cli import main
    from launcher.cli.options import in_generate_flags, in_tp_flag

    root = fake_compiled_dir(tmp_path / "c", model_dir, tp_degree=0)
    argv = {"generate": ["generate", "--compiled", str(root), "Hello"],
            "compile": ["compile", "--model", str(model_dir), "--tp", "1", "--compiled", str(root)]}[command]
    if command == "compile":  # a directory holding someone else's manifest.json, given as --out
        (tmp_path / "web").mkdir()
        (tmp_path / "web" / "manifest.json").write_text('{"name": "a web app"}')
        argv = ["compile", "--model", str(model_dir), "--tp", "1", "--out", str(tmp_path / "web")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'--tp'" not in err and "--tp," not in err, err  # (the fix's `compile --tp N` is an option)
    named = "field 'tp_degree' must be a positive integer, found 0" if command == "generate" else "config_hash, tp_degree,"
    assert named in err, err
    # the planner's words are still the options' (a key in a file, a path or a call is not one)
    assert in_tp_flag("tp_degree (3) does not split evenly") == "--tp (3) does not split evenly"
    assert in_generate_flags("with max_new_tokens 9000 that needs 9005 positions but seq_len is 4096; lower "
                             "max_new_tokens, or raise seq_len") == (
        "with --max-new-tokens 9000 that needs 9005 positions but --seq-len is 4096; lower --max-new-tokens, or "
        "raise --seq-len")
    for kept in ("m.json lacks tp_degree; write it", "m.json lacks dtype, tp_degree; write it",
                 "field 'seq_len' must be", 'key "batch_size" is', "/runs/tp_degree/m", "for_model(config, tp_degree, kv)"):
        assert in_generate_flags(kept) == kept


def test_another_model_is_refused(model_dir, tmp_path):
    other = save_model(build_random_model("llama", seed=3, vocab_size=VOCAB, num_layers=3), tmp_path / "other")
    root = fake_compiled_dir(tmp_path / "c", model_dir)
    with pytest.raises(ValueError, match=r"model: expected config hash \w+ .*found \w+ \(" + str(other)):
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), model=str(other)))


def test_a_matching_launch_takes_the_directory_settings(model_dir, tmp_path):
    root = fake_compiled_dir(tmp_path / "c", model_dir)
    # the flags it was compiled with are taken again: a --max-context-length past the sequence
    # length (16) was capped to it, and one beside --buckets stopped the list there
    compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), max_context_length=1024))
    compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), context_buckets=(8, 16),
                                                 max_context_length=20))
    config = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), model=str(model_dir)))
    assert (config.tp, config.dtype, config.seq_len, config.max_batch_size) == (1, "float32", 16, 1)
    assert config.presharded_dir == str(root / "weights") and config.context_buckets == (8, 16)
    compiled_at_lnc_2 = fake_compiled_dir(tmp_path / "c2", model_dir, lnc=2)
    assert compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(compiled_at_lnc_2))).lnc == 2


def test_a_launch_keeps_to_the_version_it_checked(model_dir, tmp_path):
    """The directory's link was followed again by every rank and every restart: a `corelaunch
    compile` into the same --out under a running server made a restarted group load the new
    version's weights with the old settings, unchecked."""
    first = fake_compiled_dir(tmp_path / ".c.v-host-1-aaaaaaaa", model_dir)
    (tmp_path / "c").symlink_to(first.name)
    config = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(tmp_path / "c")))
    other = fake_compiled_dir(tmp_path / ".c.v-host-2-bbbbbbbb", model_dir)
    (tmp_path / "c").unlink()
    (tmp_path / "c").symlink_to(other.name)  # what the next compile's swap does
    assert config.compiled_dir == str(first) and config.presharded_dir == str(first / "weights")
    assert config.model == str(first / "model")
    from launcher.artifacts.compiled_dir import load_spec_fields
    from shardlib.model_config import load_model_config
    from shardlib.planner import plan

    spec = load_spec_fields(config, plan(load_model_config(config.model), tp=1, seq_len=16),
                            load_model_config(config.model))
    assert spec["compile_cache_dir"] == str(first / "cache")


def test_serve_plans_a_compiled_directory_as_its_replicas_run_it(model_dir, tmp_path, monkeypatch):
    """`serve --compiled DIR` planned the built-in SmolLM2 before Serve started (no --model), so its
    memory check and its refusals (TP against SmolLM2's heads) were another model's."""
    from launcher import launch_plan
    from launcher.cli import serve_command
    from launcher.serving.server_settings import settings_from_args

    from shardlib.model_config import load_model_config
    from shardlib.presharded import save_presharded
    from shardlib.sharding import ShardLayout

    root = fake_compiled_dir(tmp_path / "c", model_dir)
    config = load_model_config(model_dir)  # the weights too: planning checks them before any start
    save_presharded(root / "weights", model_dir, config, ShardLayout.for_model(config, 1), dtype="float32")
    planned = []
    real = launch_plan.plan_launch

    def spy(config, progress):
        planned.append(config)
        return real(config, progress)

    monkeypatch.setattr(launch_plan, "plan_launch", spy)
    serve_command._plan(settings_from_args({"compiled_dir": str(root), "backend": "cpu"}))
    assert planned[0].model == str(root / "model") and planned[0].seq_len == 16
    # builder arguments are LaunchConfig's fields, and named so (`corelaunch serve` says --tp)
    with pytest.raises(ValueError, match=r"launch: tp: expected 1 \(compiled\), found 2 \(asked\)"):
        serve_command._plan(settings_from_args({"compiled_dir": str(root), "backend": "cpu", "tp": 2}))
    # as `corelaunch compile` leaves it, a link to a hidden version: the refusal names the link
    # given (it named the pinned .c1.v-... version)
    version = root.rename(tmp_path / ".c1.v-host-1-abc")
    link = tmp_path / "c1"
    link.symlink_to(version.name)
    with pytest.raises(ValueError, match=rf"compiled-model directory {link} does not match this launch: tp: expected"):
        settings_from_args({"compiled_dir": str(link), "backend": "cpu", "tp": 2})


def corelaunch_in_process(capsys, *args: str) -> tuple[int, str]:
    """`corelaunch ARGS` through launcher.cli.main in this process: (exit code, stderr)."""
    from launcher.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_cli_refusals_exit_2_before_starting_anything(model_dir, tmp_path, capsys, in_process_cluster):
    root = fake_compiled_dir(tmp_path / "c", model_dir)
    code, err = corelaunch_in_process(capsys, "generate", "--compiled", str(root), "--tp", "2", "--quiet", "t1 t2")
    assert code == 2 and "--tp: expected 1 (compiled), found 2 (asked)" in err
    code, err = corelaunch_in_process(capsys, "generate", "--compiled", str(tmp_path / "nope"), "t1")
    assert code == 2 and "does not exist" in err
    # lists given with --buckets are named by it (they were named --token-buckets and --context-buckets)
    code, err = corelaunch_in_process(capsys, "generate", "--compiled", str(root), "--buckets", "8,32", "--quiet", "t1")
    assert code == 2 and ("--buckets (its token-generation list): expected [16] (compiled), found [8, 32] (asked); "
                          "--buckets (its context-encoding list): expected [8, 16] (compiled), found [8, 32]") in err, err
    assert "--token-buckets" not in err and "--context-buckets" not in err, err
    code, err = corelaunch_in_process(capsys, "generate", "--compiled", str(root), "--buckets", "8,32",
                                      "--context-buckets", "8,16", "--quiet", "t1")
    assert code == 2 and "--buckets (its token-generation list): expected [16]" in err, err
    code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--out", str(model_dir))
    assert code == 2 and "is not a compiled-model directory" in err
    code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--buckets", "8,x", "--out",
                                      str(tmp_path / "o"))
    assert code == 2 and "comma-separated integers" in err
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal
        corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--granularity", "graph",
                              "--buckets", "16", "--out", str(tmp_path / "o"))
    assert exited.value.code == 2 and "invalid choice: 'graph'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written
    assert in_process_cluster.groups == []  # and before any group was started


def test_compile_refuses_an_out_it_cannot_write_naming_it(model_dir, tmp_path, capsys, monkeypatch, ray_tripwire):
    """A file as --out, or below one, was a traceback or a bare errno text; checked now before the
    plan, and a write the filesystem refuses names --out too."""
    from launcher import launch_plan

    afile = tmp_path / "afile"
    afile.write_text("")
    plan_launch = launch_plan.plan_launch

    def no_plan(*args, **kwargs):
        raise AssertionError("compile planned the launch before refusing --out")

    monkeypatch.setattr(launch_plan, "plan_launch", no_plan)
    for out, message in ((afile, f"--out {afile} exists and is not a directory"),
                         (afile / "sub", f"--out {afile / 'sub'} cannot be written: {afile} is a file, not a "
                                         f"directory"),
                         (afile / "a" / "b", f"cannot be written: {afile} is a file")):
        code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--buckets", "16", "--out",
                                          str(out))
        assert code == 2 and message in err and "Traceback" not in err, err
    assert afile.read_text() == ""

    # A directory with a manifest.json of its own (a web app's), and a compiled directory's weights
    # (a pre-sharded checkpoint), were replaced whole: a manifest.json is not enough
    webapp = tmp_path / "webapp"
    (webapp / "src").mkdir(parents=True)
    (webapp / "manifest.json").write_text('{"name": "my app", "start_url": "/"}')
    (webapp / "src" / "app.js").write_text("keep me")
    presharded = fake_compiled_dir(tmp_path / "c", model_dir) / "weights"
    (presharded / "manifest.json").write_text('{"format_version": 1, "config_hash": "x", "model_type": "llama", '
                                              '"tp_degree": 1, "kv_strategy": "shard", "dtype": "float32", "files": []}')
    for out in (webapp, presharded):
        code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--buckets", "16", "--out",
                                          str(out))
        assert code == 2 and f"--out {out} exists and is not a compiled-model directory (its manifest.json is " \
            f"not one:" in err, err
    assert (webapp / "src" / "app.js").read_text() == "keep me"
    # names that the final swap cannot replace, and whitespace the C++ compiler's command splits on,
    # failed only after the whole compile
    for out, message in ((".", "names no directory of its own"), (str(tmp_path / "x" / ".."), "names no directory"),
                         (str(tmp_path / "sp ace" / "c1"), "has whitespace, a quote or a backslash in its path"),
                         (str(tmp_path / "q'x"), "has whitespace, a quote or a backslash in its path")):
        code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--buckets", "16", "--out", out)
        assert code == 2 and message in err, err

    # /proc takes no new entry even from root, whose permissions let the look pass: the refused
    # write (after the plan, before Ray) names --out and the fix
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    monkeypatch.setattr(launch_plan, "plan_launch", plan_launch)
    code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--buckets", "16", "--quiet",
                                      "--out", "/proc/corelaunch-test-cdir")
    assert code == 2 and "--out /proc/corelaunch-test-cdir" in err and "a directory you can write to" in err, err


def test_a_compiled_directory_at_a_path_the_compiler_cannot_take_is_refused_before_start(model_dir, tmp_path):
    """Copied to a path with a space (or a quote), its first graph not in the cache crashed the group
    (a raw g++ error) three times over, then the launch: refused now, naming the fix."""
    import shutil

    root = fake_compiled_dir(tmp_path / "c", model_dir)
    for name in ("sp ace", "q'x"):
        moved = Path(shutil.copytree(root, tmp_path / name / "c1", symlinks=False))
        with pytest.raises(ValueError, match=r"lies at a path with whitespace, a quote or a backslash .*copy it "
                                             r"\(cp -rL\) to a path without them"):
            LaunchConfig(compiled_dir=str(moved))
    LaunchConfig(compiled_dir=str(root))  # a plain path is taken


def test_a_compiled_directory_that_cannot_be_written_is_refused_before_start(model_dir, tmp_path, monkeypatch):
    """On a read-only volume each rank failed at load (inductor's lock files), restarted to the
    restart limit. The tests may run as root, whom permission bits do not stop, so the look the
    check makes (os.access, which a read-only mount fails for root too) answers as it would there."""
    import os

    root = fake_compiled_dir(tmp_path / "c", model_dir)
    cache = compiled_dir.cache_dir(Path(root).resolve())
    cache.mkdir(parents=True, exist_ok=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == cache and mode & os.W_OK
                        else real_access(path, mode, **kw))
    with pytest.raises(ValueError, match=r"cannot be written .*inductor writes lock files into its cache.*copy it "
                                         r"\(cp -rL\) to a writable path"):
        LaunchConfig(compiled_dir=str(root))


@pytest.mark.slow
def test_the_console_script_exits_2_on_a_refusal(model_dir, tmp_path):
    """The same exit through `python -m launcher` (one subprocess: the exit code reaches the shell)."""
    root = fake_compiled_dir(tmp_path / "c", model_dir)
    wrong_tp = corelaunch("generate", "--compiled", str(root), "--tp", "2", "--quiet", "t1 t2", timeout=60)
    assert wrong_tp.returncode == 2 and "--tp: expected 1 (compiled), found 2 (asked)" in wrong_tp.stderr


@pytest.mark.parametrize("field, value, message", [
    ("tp_degree", -1, "field 'tp_degree' must be a positive integer, found -1"),
    ("lnc", 3, "field 'lnc' must be one of 1, 2, found 3"),
    ("granularity", "huge", "field 'granularity' must be one of model, layer, model-decode, collective, None, "
                            "found 'huge'"),
    ("kv_strategy", "bogus", "field 'kv_strategy' must be one of shard, replicate_to_tp, convert_to_mha"),
    ("buckets", {"context": [8], "token": [-16], "batch": [1]}, "field 'buckets' is not a valid set of buckets"),
    ("kv_cache_dtype", "bogus", "field 'kv_cache_dtype' must be one of f8e4m3, None, found 'bogus'"),  # named a flag
    ("max_num_seqs", 0, "field 'max_num_seqs' must be a positive integer, found 0"),
    ("max_prefill_tokens", 0, "field 'max_prefill_tokens' must be a positive integer, found 0"),
    ("fused_projections", "yes", "field 'fused_projections'"),
])
def test_a_manifest_value_no_compile_writes_is_named_as_the_manifests(model_dir, tmp_path, field, value, message):
    """Such values were refused by the launch's own checks, naming a flag nobody passed
    (`--tp (-1) must be a positive integer`), and not the file."""
    root = fake_compiled_dir(tmp_path / "c", model_dir, **{field: value})
    with pytest.raises(ValueError) as refused:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root)))
    assert str(root / "manifest.json") in str(refused.value) and message in str(refused.value), refused.value
    assert "corelaunch compile" in str(refused.value)


def test_a_version_a_killed_compile_left_is_refused_when_named_directly(model_dir, tmp_path):
    """`--compiled .c4.v-HOST-PID-RANDOM` (the hidden version a SIGKILLed compile left, its link
    never made) ran, and compiled graphs into the partial directory."""
    from shardlib.process_alive import writer_tag

    host = writer_tag().rsplit("-", 1)[0]
    dead = fake_compiled_dir(tmp_path / f".c4.v-{host}-999999999-0123abcd", model_dir)  # no compile_s
    with pytest.raises(ValueError, match=r"was left half-written by a `corelaunch compile` that did not finish"):
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(dead)))
    # the same while its writer runs (a compile's own launch), or once finished: taken
    alive = fake_compiled_dir(tmp_path / f".c5.v-{writer_tag()}-0123abcd", model_dir)
    assert compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(alive))).tp == 1
    done = fake_compiled_dir(tmp_path / f".c6.v-{host}-999999999-0123abcd", model_dir, compile_s=3.0)
    assert compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(done))).tp == 1


def test_generate_and_serve_warm_up_only_the_serving_graphs():
    """They run continuous batching alone, and --warm-up also built every static batch's graph
    (with defaults 48 of them, most of the start), never used."""
    import argparse

    from launcher.artifacts.compiled_dir import load_spec_fields
    from launcher.cli import generate_command
    from launcher.serving.server_settings import settings_from_args

    parser = argparse.ArgumentParser()
    generate_command.add_parser(parser.add_subparsers())
    config = generate_command.launch_config(parser.parse_args(["generate", "--warm-up", "--tp", "1", "x"]))
    assert config.warm_up and not config.warm_up_static
    served = settings_from_args({"warm_up": True, "backend": "cpu"}).launch
    assert served["warm_up"] and served["warm_up_static"] is False
    with pytest.raises(ValueError, match=r"warm_up_static \(True\) does not apply to a server: a server runs "
                                         r"continuous batching alone"):
        settings_from_args({"warm_up_static": True})
    plan = SimpleNamespace(seq_len=256)
    model = SimpleNamespace(max_position_embeddings=256)
    fields = lambda **kw: load_spec_fields(LaunchConfig(compile=True, **kw), plan, model)  # noqa: E731
    assert fields(warm_up=True)["warm_up"] and not fields(warm_up=True, warm_up_static=False)["warm_up"]


def test_max_num_seqs_left_out_is_the_compiled_directorys(model_dir, tmp_path):
    """The serving graphs' shapes hold the KV cache's rows (max_num_seqs + 1): a directory compiled
    with --max-num-seqs 2 started by `generate` (8) or `serve` (16) without the flag rebuilt every
    serving graph, while the README said only larger values compiled anything."""
    import argparse

    from launcher.cli import serve_command
    from launcher.serving.server_settings import settings_from_args
    from shardlib.serving_shapes import DEFAULT_MAX_NUM_SEQS

    root = fake_compiled_dir(tmp_path / "c", model_dir, max_num_seqs=2)
    assert LaunchConfig(compiled_dir=str(root)).max_num_seqs == 2
    assert LaunchConfig(compiled_dir=str(root), max_num_seqs=4).max_num_seqs == 4  # asked: taken
    assert LaunchConfig(**settings_from_args({"compiled_dir": str(root), "backend": "cpu"}).launch).max_num_seqs == 2
    parser = argparse.ArgumentParser()
    serve_command.add_parser(parser.add_subparsers())
    served = lambda *argv: serve_command.server_args(parser.parse_args(["serve", *argv]))["max_num_seqs"]
    assert served("--compiled", str(root)) == 2 and served() == serve_command.SERVE_MAX_NUM_SEQS
    assert served("--compiled", str(root), "--max-num-seqs", "3") == 3
    # a directory compiled before the value was recorded: the defaults, as before
    old = fake_compiled_dir(tmp_path / "old", model_dir)
    assert LaunchConfig(compiled_dir=str(old)).max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert served("--compiled", str(old)) == serve_command.SERVE_MAX_NUM_SEQS


def test_a_compiled_directory_given_as_presharded_weights_is_refused_before_the_ranks(model_dir, tmp_path):
    """It passed every check before Ray and failed only at the ranks' load ("lacks files")."""
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress

    root = fake_compiled_dir(tmp_path / "c", model_dir)
    with pytest.raises(ValueError, match=rf"--presharded {root} is a compiled-model directory.*--compiled {root}"):
        plan_launch(LaunchConfig(model=str(model_dir), tp=1, presharded_dir=str(root)), Progress(False))


def test_a_static_batch_without_seq_len_keeps_to_the_positions_the_plan_counted():
    """The plan's memory check counts min(max_position_embeddings, 4096) positions a row without
    --seq-len; an eager static batch sized its cache per request up to max_position_embeddings, so
    a 6000-token prompt on the demo model (8192 positions) was taken, its cache past the plan's."""
    from launcher.api import Launcher

    llm = Launcher(LaunchConfig(compile=False, max_batch_size=8, progress=False))
    llm.prepare()  # plans only: no Ray, no worker
    assert llm.config.seq_len is None and llm.plan.seq_len == 4096 < llm.model_config.max_position_embeddings
    with pytest.raises(ValueError, match=r"^the prompt has 6000 tokens; with max_new_tokens 64 that needs 6064 "
                                         r"positions but seq_len is 4096: .*raise seq_len \(--seq-len\)$"):
        llm._check_lengths([[1] * 6000], 64)
    llm._check_lengths([[1] * 4000], 96)  # exactly the plan's positions


def test_a_longest_prompt_past_seq_len_is_refused_naming_both():
    """The context buckets stopped at seq_len, silently: --max-context-length 8192 --seq-len 4096
    took no prompt past 4096."""
    with pytest.raises(ValueError, match=r"^max_context_length \(8192\) exceeds seq_len \(4096\), the most "
                                         r"positions a sequence holds, its prompt included: lower "
                                         r"max_context_length or raise seq_len$"):
        LaunchConfig(max_context_length=8192, seq_len=4096)
    LaunchConfig(max_context_length=4096, seq_len=4096)


def test_a_prompt_past_a_compiled_directorys_context_buckets_names_a_fix_that_works():
    """"use larger context-encoding buckets" was the fix, while --compiled refuses other buckets."""
    from launcher.api import Launcher
    from shardlib.buckets import Buckets

    def check(compiled, prompts=1):
        launcher = SimpleNamespace(model_config=SimpleNamespace(max_position_embeddings=8192), serving_seq_len=256,
                                   config=SimpleNamespace(seq_len=256, compiled_dir=compiled, token_buckets=None),
                                   buckets=Buckets.build(max_context_length=128, max_seq_len=256, max_batch_size=1))
        with pytest.raises(ValueError) as refused:
            Launcher._check_lengths(launcher, [[5]] * (prompts - 1) + [list(range(129))], 8)
        return str(refused.value)

    # one prompt is not told by an index ("prompt 0: prompt length"); one of several is
    assert check("/c3", prompts=2).startswith("prompt 1: prompt length (129) is longer")
    assert check(None, prompts=3).startswith("prompt 2: ")
    assert check("/c3") == ("prompt length (129) is longer than the largest context-encoding bucket (128) "
                            "of the compiled directory; shorten the prompt, or compile the directory again with a "
                            "larger --max-context-length (or --context-buckets)")
    assert "use larger context-encoding buckets" in check(None)  # a launch of its own: its own buckets


def test_max_prefill_tokens_and_fused_projections_left_out_are_the_compiled_directorys(model_dir, tmp_path):
    """Both shape graphs (the prefill chunks' widths; fused or separate matrices) and `compile` took
    neither, so a server started from a directory with `--max-prefill-tokens 512` or
    `--fused-projections` built its graphs on first use every time. `compile` takes and records
    them; a launch from the directory that gives none takes the recorded ones, and one that gives
    its own is taken (its graphs built on first use)."""
    import argparse

    from launcher.cli import compile_command, generate_command, serve_command
    from launcher.serving.server_settings import settings_from_args
    from shardlib.serving_shapes import DEFAULT_MAX_PREFILL_TOKENS

    root = fake_compiled_dir(tmp_path / "c", model_dir, max_prefill_tokens=512, fused_projections=True)
    config = LaunchConfig(compiled_dir=str(root))
    assert config.max_prefill_tokens == 512 and config.fused_projections is True
    asked = LaunchConfig(compiled_dir=str(root), max_prefill_tokens=1024, fused_projections=False)
    assert asked.max_prefill_tokens == 1024 and asked.fused_projections is False
    served = LaunchConfig(**settings_from_args({"compiled_dir": str(root), "backend": "cpu"}).launch)
    assert served.max_prefill_tokens == 512 and served.fused_projections is True
    # no directory, or one compiled before they were recorded: the defaults
    old = fake_compiled_dir(tmp_path / "old", model_dir)
    for config in (LaunchConfig(), LaunchConfig(compiled_dir=str(old))):
        assert config.max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS and config.fused_projections is False

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    for command in (compile_command, generate_command, serve_command):
        command.add_parser(commands)
    assert generate_command.launch_config(parser.parse_args(["generate", "--compiled", str(root), "x"])).fused_projections
    serve_args = lambda *argv: LaunchConfig(**settings_from_args(  # noqa: E731
        serve_command.server_args(parser.parse_args(["serve", "--backend", "cpu", *argv]))).launch)
    assert serve_args("--compiled", str(root)).max_prefill_tokens == 512
    assert serve_args("--compiled", str(root), "--max-prefill-tokens", "64").max_prefill_tokens == 64
    compiling = parser.parse_args(["compile", "--out", "o", "--max-prefill-tokens", "256", "--fused-projections"])
    assert compiling.max_prefill_tokens == 256 and compiling.fused_projections is True
    plain = parser.parse_args(["compile", "--out", "o"])
    assert plain.max_prefill_tokens is None and plain.fused_projections is False


def test_compile_progress_waits_for_a_whole_line(tmp_path):
    """The follower split every line it read into six fields: a line rank 0 was still writing (no
    newline yet) raised in its thread, and the rest of the progress was lost behind a traceback."""
    import threading

    from launcher.cli.compile_command import _GraphProgress

    log = tmp_path / "compile.log"
    log.write_text("1 4 context 1 16 0.5\n2 4 tok")  # the second line half-written
    notes = []
    progress = SimpleNamespace(note=notes.append)
    failures = []
    threading.excepthook, before = (lambda args: failures.append(args.exc_value)), threading.excepthook
    try:
        with _GraphProgress(log, progress):
            time.sleep(0.7)
            log.write_text("1 4 context 1 16 0.5\n2 4 token 1 16 0.25\n")
            time.sleep(0.7)
    finally:
        threading.excepthook = before
    assert not failures, failures
    assert len(notes) == 2 and notes[1].startswith("  graph 2/4:") and "(0.2 s)" in notes[1], notes


def test_each_start_holds_its_compiled_version_and_a_version_removed_meanwhile_is_named(model_dir, tmp_path,
                                                                                        monkeypatch):
    """start() holds the version prepare() pinned, each time: a start after shutdown() ran unheld (the
    hold had moved into the once-only prepare(), where a Launcher only prepared, then dropped, also
    kept it for the life of the process). A compile that removed the version between prepare() and
    start() is named, not left to fail on missing files."""
    import shutil

    from launcher.api import Launcher
    from launcher.errors import LaunchError
    from shardlib.atomic_dir import in_use
    from shardlib.model_config import load_model_config
    from shardlib.presharded import save_presharded
    from shardlib.sharding import ShardLayout

    root = fake_compiled_dir(tmp_path / "c", model_dir)
    for item in model_dir.iterdir():
        if item.is_file():
            shutil.copy(item, root / "model" / item.name)
    config = load_model_config(model_dir)
    save_presharded(root / "weights", model_dir, config, ShardLayout.for_model(config, 1))
    monkeypatch.setattr(Launcher, "_start_group", lambda self, backend: None)  # the hold, not the ranks
    launcher = Launcher(LaunchConfig(compiled_dir=str(root), progress=False))
    launcher.prepare()
    assert not in_use(root)  # only prepared: nothing runs from it yet
    for _ in range(2):  # started, shut down, started again
        try:
            launcher.start()
            assert in_use(root)
        finally:
            launcher.shutdown()
        assert not in_use(root)

    moved = tmp_path / "moved"
    later = Launcher(LaunchConfig(compiled_dir=str(root), progress=False)).prepare()
    root.rename(moved)  # as the sweep after a compile into the same --out removes it
    with pytest.raises(LaunchError, match=rf"the compiled directory's version {root} this launch pinned was "
                                          r"removed before it started .* create a new Launcher \(or run the "
                                          r"command again\)"):
        later.start()
    later.shutdown()


def test_a_directory_missing_its_model_config_is_named_incomplete(model_dir, tmp_path):
    """It was told "pass a model directory containing config.json" (--model's advice), about a file
    inside the compiled directory."""
    root = fake_compiled_dir(tmp_path / "c", model_dir)
    (root / "model" / "config.json").unlink()
    with pytest.raises(ValueError) as err:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root)))
    assert str(err.value) == (f"compiled-model directory {root} is incomplete: it has no {root}/model/config.json; "
                              f"copy the whole directory again (cp -rL), or re-run `corelaunch compile --out {root}`")


def test_an_edited_model_config_inside_the_directory_is_named_with_the_compile_fix(model_dir, tmp_path):
    """It reached the ranks' load and was refused as a pre-sharded checkpoint "written for other
    settings", told to re-run save_presharded, a Python function no command-line user had called."""
    root = fake_compiled_dir(tmp_path / "c", model_dir)
    edited = json.loads((root / "model" / "config.json").read_text())
    edited["rms_norm_eps"] = edited.get("rms_norm_eps", 1e-6) * 10
    (root / "model" / "config.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError) as err:
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root)))
    assert f"compiled-model directory {root}: {root}/model/config.json was changed after it was compiled" in str(
        err.value) and f"re-run `corelaunch compile --out {root}`" in str(err.value), err.value
    # with --model the original's config is compared instead (the model the user names), as before
    compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), model=str(model_dir)))


def test_a_compiled_directory_keeps_the_tokenizers_added_tokens(tmp_path):
    """A review: added_tokens.json was not copied into the directory's model folder, so a tokenizer
    that keeps its added tokens there (vocab.json and merges.txt, or tokenizer.model) read them as
    plain text under --compiled, and the prompts' ids differed from the model folder's."""
    from launcher.cli.compile_command import _copy_model_files

    source = tmp_path / "model"
    source.mkdir()
    for name, text in (("config.json", "{}"), ("vocab.json", "{}"), ("merges.txt", "#version: 0.2\n"),
                       ("added_tokens.json", '{"<|mytool|>": 49152}'), ("model.safetensors", "weights")):
        (source / name).write_text(text)
    _copy_model_files(source, tmp_path / "copied")
    assert sorted(p.name for p in (tmp_path / "copied").iterdir()) == ["added_tokens.json", "config.json",
                                                                       "merges.txt", "vocab.json"]


def test_compile_refuses_a_max_batch_size_of_0(capsys, tmp_path):
    """A review: LaunchConfig's 0 (no static batches) passed compile's flag and built batch 1's
    static graphs all the same; a compiled directory holds static graphs from batch 1 up. (The
    model path names nothing: should the flag pass again, the command fails at once, not compiling.)"""
    from launcher.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--model", str(tmp_path / "none"), "--max-batch-size", "0", "--out", str(tmp_path / "c")])
    assert exit_.value.code == 2 and "--max-batch-size" in capsys.readouterr().err
