"""`corelaunch check` and `corelaunch bench` end to end on random checkpoints.

The check runs in this process and must pass against the transformers reference of the same
checkpoint, and fail for a copy whose weights were perturbed while the reference stays the
original. The passing check runs twice: on real Ray TP groups with compiled graphs (sharing the
session's Ray instance; slow) and with the Launcher's groups in-process, eagerly
(tests/in_process_cluster.py; fast). Token matching, which reads the same generate call as logit
matching, the failing check and the saved reference run in-process only: their subject is the
report, which is the same whichever way the group runs. The bench
runs as a subprocess with --json on the session's Ray (slow), and in-process through main() (fast).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.cli import main
from launcher.cli.check_command import format_report
from tests.model_factory import save_random_model

REPO = Path(__file__).resolve().parents[1]
PROMPT_IDS = "5,17,42,9"
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(original, perturbed): a random Llama (4 heads, 2 KV heads) and a copy with noise added to one
    layer's MLP down projection: enough to move the logits past logit matching's tolerances, too
    little to change a greedy token."""
    root = tmp_path_factory.mktemp("check_models")
    original = save_random_model(root / "original", num_heads=4, num_kv_heads=2, seed=3)
    return original, perturbed_copy(original, root / "perturbed", 0.05)


def perturbed_copy(original: Path, to: Path, scale: float) -> Path:
    """A copy of the model with `scale` times Gaussian noise added to layer 1's MLP down projection."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(original, to)
    state = load_file(to / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    noise = torch.randn(state[name].shape, generator=torch.Generator().manual_seed(0))
    state[name] = state[name] + scale * noise
    save_file(state, to / "model.safetensors", metadata={"format": "pt"})
    return to


def run_check(capsys, *args: str) -> tuple[int, dict | None, str]:
    """Run `corelaunch check ... --json --quiet` in this process: (exit code, report, stderr)."""
    capsys.readouterr()
    code = main(["check", "--json", "--quiet", *args])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else None), out.err


def test_command_modules_import_neither_torch_nor_ray():
    code = ("import argparse, sys\n"
            "import launcher.cli.check_command as c, launcher.cli.bench_command as b\n"
            "sub = argparse.ArgumentParser().add_subparsers()\n"
            "c.add_parser(sub); b.add_parser(sub)\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.fixture(params=[pytest.param("ray", marks=pytest.mark.slow), "in-process"])
def where(request) -> list[str]:
    """Where the checks' TP groups run: real Ray workers with the default compiled graphs (slow),
    or in-process groups, eagerly (fast). The extra command-line arguments that takes."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
        return []
    request.getfixturevalue("in_process_cluster")
    return ["--no-compile"]


def test_compiling_is_the_default_of_check_and_bench():
    from launcher.cli import build_parser

    for command in ("check", "bench"):
        assert build_parser().parse_args([command]).compile is True
        assert build_parser().parse_args([command, "--no-compile"]).compile is False


def test_check_passes_token_and_logit_matching_against_transformers_at_tp2(models, capsys, where):
    original, _ = models
    common = ["--model", str(original), "--tp", "2", "--prompt-ids", PROMPT_IDS, "--prompt-ids", "8,60,21",
              "--num-tokens", str(NUM_TOKENS), *where]
    # token matching in-process only: both modes take corelaunch's tokens and logits from the same
    # generate call, so on Ray the logit-matching launch below runs that path (and its first pass
    # must give the expected tokens); a second compiled Ray launch would check nothing more
    if "--no-compile" in where:  # in-process
        check_token_matching_passes(capsys, common)

    code, report, err = run_check(capsys, "--mode", "logit-matching", *common)
    assert code == 0, err
    assert report["passed"] and report["num_tokens"] == NUM_TOKENS and report["tp_degree"] == 2
    # by default the compiled graphs users run are what is checked
    assert report["compile"] is ("--no-compile" not in where)
    assert report["tol_map"]["top5"] == {"atol": 1e-5, "rtol": 0.01}
    assert [p["input_ids"] for p in report["prompts"]] == [[5, 17, 42, 9], [8, 60, 21]]
    for p in report["prompts"]:
        assert p["passed"] and p["runs"] == 1 and p["divergences"] == [] and p["first_failure"] is None
        assert p["first_pass_tokens"] == p["expected_tokens"] and len(p["expected_tokens"]) == NUM_TOKENS
        assert set(p["top_k"]) == {"top5", "top50", "top1000", "all"}
        assert all(g["passed"] and g["max_abs_error"] < 1e-3 for g in p["top_k"].values())


def test_check_runs_the_layout_choices_generate_and_serve_take(capsys, tmp_path, in_process_cluster):
    """check had no --moe-sharding, --kv-strategy or --fused-projections: an expert-parallel or fused
    layout a server ran could not be checked."""
    moe = save_random_model(tmp_path / "moe", "qwen3_moe", num_heads=4, num_kv_heads=2, seed=5)
    common = ["--model", str(moe), "--tp", "2", "--prompt-ids", PROMPT_IDS, "--num-tokens", "4", "--no-compile"]
    code, report, err = run_check(capsys, "--mode", "logit-matching", *common, "--moe-sharding", "expert_parallel",
                                  "--kv-strategy", "convert_to_mha", "--fused-projections")
    assert code == 0, err
    assert report["passed"] and report["moe_sharding"] == "expert_parallel"
    assert report["kv_strategy"] == "convert_to_mha" and report["fused_projections"] is True
    assert "expert_parallel experts" in format_report(report)
    code, report, err = run_check(capsys, "--mode", "token-matching", *common)
    assert code == 0 and report["fused_projections"] is False and report["kv_strategy"] == "shard", err


def check_token_matching_passes(capsys, common: list[str]) -> None:
    code, report, err = run_check(capsys, "--mode", "token-matching", *common)
    assert code == 0, err
    assert report["passed"] and report["tp_degree"] == 2 and report["mode"] == "token-matching"
    assert [p["input_ids"] for p in report["prompts"]] == [[5, 17, 42, 9], [8, 60, 21]]
    for p in report["prompts"]:
        assert p["passed"] and p["first_divergence"] is None
        assert p["actual_tokens"] == p["expected_tokens"] and len(p["actual_tokens"]) == NUM_TOKENS


def test_a_reference_with_another_vocabulary_is_refused_before_anything_runs(models, capsys, tmp_path,
                                                                             monkeypatch, ray_tripwire):
    """Found only after the reference had run and the workers started, or, with a prompt id only the
    model's vocabulary holds, as a traceback from inside transformers (exit 1, "failed")."""
    from launcher.cli import check_command

    original, _ = models
    wider = save_random_model(tmp_path / "wider", num_heads=4, num_kv_heads=2, vocab_size=256, seed=3)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the transformers reference ran")

    monkeypatch.setattr(check_command, "reference_outputs", must_not_run)
    for prompt_ids in (PROMPT_IDS, "5,200"):  # 200: past the reference's 128 tokens
        code, report, err = run_check(capsys, "--model", str(wider), "--reference", str(original),
                                      "--prompt-ids", prompt_ids, "--no-compile")
        assert code == 2 and report is None, err
        assert f"--reference {original} has a vocabulary of 128 tokens and --model {wider} one of 256" in err, err


def test_a_reference_or_model_that_transformers_cannot_load_is_refused_naming_the_option(models, capsys, tmp_path,
                                                                                          monkeypatch, ray_tripwire):
    """A corrupt or missing weights file, or a config.json given for its folder, was a traceback
    from inside transformers' reference with exit 1 (a failed check's code), or transformers' own
    words naming no option; a folder given as --expected "did not exist"."""
    from launcher.cli import check_command

    original, _ = models
    corrupt = tmp_path / "corrupt"
    shutil.copytree(original, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 1000)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(original / "config.json", config_only / "config.json")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the transformers reference ran")

    monkeypatch.setattr(check_command, "reference_outputs", must_not_run)
    saving = ["--save-expected", str(tmp_path / "e.pt")]
    for args, message in (
            (["--reference", str(corrupt)], f"--reference {corrupt}: {corrupt / 'model.safetensors'} is not a valid "
                                            f"safetensors file"),
            (["--reference", str(config_only)], f"--reference {config_only}: no Hugging Face checkpoint in"),
            (["--reference", str(original / "config.json")],
             f"--reference {original / 'config.json'} is a file, not a model directory; pass the Hugging Face "
             f"model directory that holds it ({original})"),
            (["--model", str(corrupt), *saving], f"--model {corrupt}: {corrupt / 'model.safetensors'} is not a valid"),
            (["--model", str(original / "config.json"), *saving], "is a file, not a model directory")):
        model = [] if "--model" in args else ["--model", str(original)]
        code, report, err = run_check(capsys, *model, *args, "--prompt-ids", PROMPT_IDS, "--no-compile")
        assert code == 2 and report is None, err
        assert message in err and "Traceback" not in err, err
    code, _, err = run_check(capsys, "--model", str(original), "--expected", str(tmp_path))
    assert code == 2 and f"expected-outputs file {tmp_path} is a directory; pass the file" in err, err


def test_a_quantized_reference_is_refused_before_anything_runs(models, capsys, tmp_path, monkeypatch):
    from launcher.cli import check_command
    from shardlib.quantize_checkpoint import quantize_checkpoint

    original, _ = models
    quantized = quantize_checkpoint(original, tmp_path / "q8", "int8")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the transformers reference ran on a quantized checkpoint")

    monkeypatch.setattr(check_command, "reference_outputs", must_not_run)
    for args, named in ((["--model", str(quantized)], str(quantized)),
                        (["--model", str(original), "--reference", str(quantized)], f"--reference {quantized}")):
        code, report, err = run_check(capsys, *args, "--prompt-ids", PROMPT_IDS, "--no-compile")
        assert code == 2 and report is None
        assert f"{named} is quantized (int8" in err and "the unquantized checkpoint" in err, err


def test_check_fails_for_perturbed_weights_and_says_where(models, capsys, in_process_cluster):
    original, perturbed = models
    # the report logic is the subject, in-process and eager: check's way through Ray and compiled
    # graphs is the passing test's above (tokens and logits come from the same generate call)
    common = ["--model", str(perturbed), "--reference", str(original), "--tp", "2",
              "--prompt-ids", PROMPT_IDS, "--num-tokens", str(NUM_TOKENS), "--no-compile"]
    code, report, _ = run_check(capsys, "--mode", "logit-matching", *common)
    assert code == 1 and not report["passed"] and report["compile"] is False
    [p] = report["prompts"]
    assert not p["passed"] and p["first_failure"]["position"] == 0  # the noise shows from the first token
    top5 = p["top_k"]["top5"]
    assert not top5["passed"] and top5["max_rel_error"] > 0.01 and 0 in top5["failed_positions"]
    assert any("top5 rel error" in line for line in p["first_failure"]["failures"])
    text = format_report(report)
    assert text.startswith("logit-matching FAILED") and "first failure at position 0:" in text
    # the verdict line says how it ran, as bench's table title does (it read like a compiled run's)
    assert text.splitlines()[0].startswith("logit-matching FAILED: corelaunch tp 2 (shard KV heads, cpu, float32, "
                                           "eager) on "), text.splitlines()[0]
    expected = p["expected_tokens"]
    assert p["first_pass_tokens"] == expected and p["divergences"] == []  # the noise moves no greedy token

    # so token matching passes this model: only logit matching sees the noise
    code, report, _ = run_check(capsys, "--mode", "token-matching", *common)
    [t] = report["prompts"]
    assert code == 0 and t["expected_tokens"] == expected and t["actual_tokens"] == expected


def test_token_matching_fails_where_the_greedy_tokens_part(models, capsys, tmp_path, in_process_cluster):
    original, _ = models
    diverging = perturbed_copy(original, tmp_path / "diverging", 2.0)  # enough noise to change tokens
    common = ["--model", str(diverging), "--reference", str(original), "--tp", "2",
              "--prompt-ids", PROMPT_IDS, "--num-tokens", str(NUM_TOKENS), "--no-compile"]
    code, report, _ = run_check(capsys, "--mode", "token-matching", *common)
    [t] = report["prompts"]
    actual, expected = t["actual_tokens"], t["expected_tokens"]
    assert code == 1 and not report["passed"] and actual != expected
    first = next(i for i, (a, b) in enumerate(zip(actual, expected)) if a != b)
    d = t["first_divergence"]
    assert d["position"] == first and d["expected_token"] == expected[first] and d["actual_token"] == actual[first]
    assert d["divergence_difference"] > 0

    code, report, _ = run_check(capsys, "--mode", "logit-matching", *common)
    [p] = report["prompts"]
    assert code == 1 and p["divergences"][0]["position"] == first and p["divergences"][0]["expected_token"] == \
        expected[first]


def test_saved_expected_outputs_are_a_reference_too(models, capsys, tmp_path, in_process_cluster):
    """Saving and reading the reference file is the subject: in-process, eager."""
    original, perturbed = models
    path = tmp_path / "expected.pt"
    code, summary, err = run_check(capsys, "--model", str(original), "--prompt-ids", PROMPT_IDS,
                                   "--num-tokens", str(NUM_TOKENS), "--save-expected", str(path))
    assert code == 0, err
    assert summary["saved"] == str(path) and summary["num_prompts"] == 1
    data = torch.load(path, weights_only=True)
    assert data["format"] == "corelaunch-expected/1" and data["input_ids"] == [[5, 17, 42, 9]]
    assert data["expected_tokens"].shape == (1, NUM_TOKENS) and data["expected_logits"].shape == (1, NUM_TOKENS, 128)
    assert torch.equal(data["expected_tokens"], data["expected_logits"].argmax(-1))

    code, report, err = run_check(capsys, "--model", str(original), "--tp", "2", "--expected", str(path),
                                  "--no-compile")
    assert code == 0 and report["passed"] and report["num_tokens"] == NUM_TOKENS, err
    assert str(path) not in report["reference"] and "transformers" in report["reference"]
    code, report, _ = run_check(capsys, "--model", str(perturbed), "--tp", "2", "--expected", str(path),
                                "--num-tokens", "4", "--no-compile")
    assert code == 1 and not report["passed"] and report["num_tokens"] == 4


def test_check_bad_input_exits_2_before_starting_workers(models, capsys, tmp_path, ray_tripwire):
    original, _ = models
    tokens_only = tmp_path / "tokens.pt"
    torch.save({"input_ids": [[5, 17]], "expected_tokens": torch.tensor([[1, 2, 3]])}, tokens_only)
    # files of another model: each reached the workers (a negative token indexed the logits from the end)
    other_model = {}
    for name, content in (("big", {"expected_tokens": torch.tensor([[5, 999]])}),
                          ("negative", {"expected_tokens": torch.tensor([[5, -6]])}),
                          ("narrow", {"expected_logits": torch.zeros(1, 2, 10)}),
                          ("nan", {"expected_logits": torch.full((1, 2, 128), math.nan)}),
                          ("format", {"expected_tokens": torch.tensor([[5, 6]]), "format": "someone-else/7"}),
                          # crashed with AttributeError (exit 1: "failed"); bools read as token ids 1 and 0
                          ("neither", {"expected_logits": None}),
                          ("bools", {"expected_tokens": torch.tensor([[True, False]])}),
                          # a review: argmax over no token raised an IndexError, a traceback and exit 1
                          ("empty", {"expected_logits": torch.zeros(1, 2, 0)})):
        other_model[name] = tmp_path / f"{name}.pt"
        torch.save({"input_ids": [[5, 17]], **content}, other_model[name])
    other_prompt = tmp_path / "other_prompt.pt"  # its input_ids were another model's: the file went unnamed
    torch.save({"input_ids": [[5, 999]], "expected_tokens": torch.tensor([[1, 2]])}, other_prompt)
    cases = [
        (["--expected", str(other_model["big"]), "--mode", "token-matching"],
         "expected_tokens: prompt 0 holds token ids [999] outside the vocabulary [0, 128) of"),
        (["--expected", str(other_model["negative"]), "--mode", "token-matching"], "holds token ids [-6] outside"),
        (["--expected", str(other_model["narrow"])], "expected_logits are 10 wide but"),
        (["--expected", str(other_model["nan"])], "expected_logits hold NaN or +inf values"),  # it passed
        (["--expected", str(other_model["format"]), "--mode", "token-matching"],
         "says format 'someone-else/7', not 'corelaunch-expected/1'"),
        (["--expected", str(tmp_path / "missing.pt")], "does not exist"),
        (["--expected", str(other_prompt), "--mode", "token-matching"],
         f"{other_prompt} does not fit {original}: its prompt 0 holds token ids [999] outside the vocabulary [0, 128); "
         f"were they tokenized for another model?; save a reference for this model with --save-expected"),
        (["--expected", str(other_model["neither"]), "--mode", "token-matching"],
         "neither expected_tokens nor expected_logits is given"),
        (["--expected", str(other_model["bools"]), "--mode", "token-matching"],
         "expected_tokens must be an integer (batch, n) or (n,) tensor"),
        (["--expected", str(other_model["empty"]), "--mode", "token-matching"],
         "expected_logits (1, 2, 0) holds no token's logits"),
        (["--expected", str(tokens_only)], "no expected_logits"),
        (["--expected", str(tokens_only), "--mode", "token-matching", "--num-tokens", "5"], "only 3"),
        (["--expected", str(tokens_only), "--prompt-ids", "1,2"], "carries its own input_ids"),
        (["some text"], "has no tokenizer"),
        (["--prompt-ids", "5,x"], "comma-separated"),
        (["--prompt-ids", "5,999"], "outside the vocabulary"),
        (["--prompt-ids", "5", "--tol-map", "5=0.1"], "K:RTOL"),
        (["--prompt-ids", "5", "--num-tokens", "0"], "at least 1"),
        (["--prompt-ids", "5", "--num-tokens", "600"], "max_position_embeddings"),
    ]
    for args, message in cases:
        code, report, err = run_check(capsys, "--model", str(original), *args)
        assert code == 2 and report is None, args
        assert message in err and err.startswith("corelaunch check: "), (args, err)
    code, _, err = run_check(capsys, "--model", str(tmp_path / "nope"), "--prompt-ids", "5")
    assert code == 2 and "does not exist" in err
    # an empty path read as none given: --save-expected "" ran the whole check and saved nothing,
    # --reference "" compared the model with itself and passed
    for option in ("--model", "--reference", "--expected", "--save-expected"):
        with pytest.raises(SystemExit) as exited:
            run_check(capsys, *(["--model", str(original)] if option != "--model" else []), option, "",
                      "--prompt-ids", "5")
        assert exited.value.code == 2 and f"{option} must be a path, not an empty string" in capsys.readouterr().err
    import pickle

    (tmp_path / "text.pt").write_text("not a torch file")
    (tmp_path / "object.pt").write_bytes(pickle.dumps({"input_ids": object()}))
    for bad in ("text.pt", "object.pt"):
        code, _, err = run_check(capsys, "--model", str(original), "--expected", str(tmp_path / bad))
        assert code == 2 and f"{tmp_path / bad} is not a readable expected-outputs file" in err, err
        assert "--save-expected" in err and "weights_only` set to `False`" not in err, err


def reference_must_not_run(monkeypatch):
    """Make the transformers reference (seconds to minutes of CPU) fail the test if it runs."""
    from launcher.cli import check_command

    def must_not_run(*args, **kwargs):
        raise AssertionError("the transformers reference ran before the refusal")

    monkeypatch.setattr(check_command, "reference_outputs", must_not_run)


def test_check_refuses_launch_options_before_the_reference_runs(models, capsys, monkeypatch, ray_tripwire):
    """They were checked only when corelaunch's side started, after the reference had run."""
    original, _ = models
    reference_must_not_run(monkeypatch)
    for tp, message in (("0", "tp (0) must be a positive integer or 'auto'"),
                        ("3", "num_attention_heads (4) is not divisible by --tp (3)")):
        code, report, err = run_check(capsys, "--model", str(original), "--prompt-ids", PROMPT_IDS, "--tp", tp,
                                      "--no-compile")
        assert code == 2 and report is None and message in err, err


def test_check_refuses_a_prompt_the_serving_rows_cannot_hold_before_the_reference_runs(capsys, monkeypatch,
                                                                                       ray_tripwire, tmp_path):
    """The prompt was checked against max_position_embeddings (8192 here) only: the reference ran
    and the workers started before the serving engine's 4096-position rows refused it, naming
    max_new_tokens and a --seq-len that check did not have. check now takes --seq-len and
    --max-num-seqs, which its plan's memory refusals name as ways out (a review: they were
    unrecognized arguments)."""
    from tests.model_factory import save_random_model

    long_context = save_random_model(tmp_path / "long", max_position_embeddings=8192, seed=3)
    reference_must_not_run(monkeypatch)
    code, report, err = run_check(capsys, "--model", str(long_context), "--prompt-ids", ",".join(["5"] * 4090),
                                  "--num-tokens", "10", "--no-compile")
    assert code == 2 and report is None, err
    assert ("the prompt has 4090 tokens; with --num-tokens 10 that needs 4100 positions but the serving cache's row "
            "(--seq-len, default min(max_position_embeddings, 4096) positions) is 4096") in err, err
    from launcher.api import Launcher

    configs = []
    monkeypatch.setattr(Launcher, "prepare", lambda self: configs.append(self.config) or
                        (_ for _ in ()).throw(ValueError("planned")))
    code, _, err = run_check(capsys, "--model", str(long_context), "--prompt-ids", "5,6", "--num-tokens", "4",
                             "--no-compile", "--seq-len", "64", "--max-num-seqs", "2")
    assert code == 2 and "planned" in err, err
    assert [(c.seq_len, c.max_num_seqs, c.max_batch_size) for c in configs] == [(64, 2, 0)]


def test_check_refuses_an_unwritable_save_expected_path_naming_the_option(models, capsys, tmp_path, monkeypatch,
                                                                          ray_tripwire):
    """A parent that is a file, or a directory as the path, was a traceback after the reference had run."""
    from launcher.cli import check_command

    original, _ = models
    (tmp_path / "afile").write_text("")
    reference_must_not_run(monkeypatch)
    weights = original / "model.safetensors"
    kept = weights.read_bytes()
    for path, message in ((tmp_path / "afile" / "x.pt", f"cannot be written: {tmp_path / 'afile'} is a file"),
                          (tmp_path, "is a directory; pass a file path"),
                          # the model's own weights were replaced without a word
                          (weights, "exists and is not an expected-outputs file; corelaunch check replaces only "
                                    "its own (the model's weights were one such file): pass a new path")):
        code, _, err = run_check(capsys, "--model", str(original), "--prompt-ids", PROMPT_IDS,
                                 "--save-expected", str(path))
        assert code == 2 and f"--save-expected {path} " in err and message in err, err
    assert weights.read_bytes() == kept

    # where the look passes but the filesystem refuses (/sys, /proc: even root): torch.save's
    # RuntimeError, once the reference has run, names the option too
    def stand_in(_dir, prompts, n, quiet=False):
        return check_command.Expected(prompts, [[1] * n for _ in prompts], torch.zeros(len(prompts), n, 128),
                                      "a stand-in reference")

    monkeypatch.setattr(check_command, "reference_outputs", stand_in)

    def refused(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                           "Permission denied")

    # an expected-outputs file is replaced whole, through a sibling: none is left when the write fails
    saved = tmp_path / "saved.pt"
    assert run_check(capsys, "--model", str(original), "--prompt-ids", PROMPT_IDS, "--num-tokens", "2",
                     "--save-expected", str(saved))[0] == 0
    assert run_check(capsys, "--model", str(original), "--prompt-ids", PROMPT_IDS, "--num-tokens", "3",
                     "--save-expected", str(saved))[0] == 0
    assert torch.load(saved, weights_only=True)["expected_tokens"].shape == (1, 3)
    monkeypatch.setattr(torch, "save", refused)
    code, _, err = run_check(capsys, "--model", str(original), "--prompt-ids", PROMPT_IDS, "--num-tokens", "2",
                             "--save-expected", str(tmp_path / "x.pt"))
    assert code == 2 and f"could not write --save-expected {tmp_path / 'x.pt'} (Permission denied)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "saved.pt"]


def test_check_refuses_arguments_that_exclude_each_other_before_looking_at_a_file(models, capsys, tmp_path,
                                                                                   ray_tripwire):
    """`--expected X --save-expected model.safetensors` was answered by the save path's check, whose
    advice was to delete the model's weights; --num-tokens 0 and the conflicts were refused only
    once --model had been found (the built-in model: converted first)."""
    original, _ = models
    reference = tmp_path / "ref.pt"
    torch.save({"input_ids": [[5, 17]], "expected_tokens": torch.tensor([[1, 2]])}, reference)
    code, report, err = run_check(capsys, "--model", str(original), "--expected", str(reference),
                                  "--save-expected", str(original / "model.safetensors"))
    assert code == 2 and report is None, err
    assert "--expected and --save-expected exclude each other" in err and "delete that file" not in err, err
    missing = tmp_path / "no-model"  # refused before --model is looked at: its absence is not what is said
    for args, message in ((["--prompt-ids", "5", "--num-tokens", "0"], "--num-tokens (0) must be at least 1"),
                          (["--expected", str(reference), "--reference", str(original)],
                           "--expected and --reference exclude each other"),
                          (["--expected", str(reference), "--prompt-ids", "5"], "carries its own input_ids")):
        code, report, err = run_check(capsys, "--model", str(missing), *args)
        assert code == 2 and report is None and message in err and "does not exist" not in err, (args, err)


def test_check_tolerances_are_honoured_or_refused_by_name(models, capsys, tmp_path, monkeypatch, ray_tripwire):
    """--divergence-difference-tol 0 was replaced by the default and inf (every divergence passes)
    was taken; --tol-map '' was replaced by the default."""
    from launcher.cli import check_command

    original, _ = models
    path = tmp_path / "expected.pt"
    torch.save({"input_ids": [[5, 17]], "expected_logits": torch.zeros(1, 2, 128)}, path)
    seen = []

    def compare(args, *rest):  # the launch itself is other tests' subject: the tolerance it gets is this one's
        seen.append(args.divergence_difference_tol)
        return {"passed": True}

    monkeypatch.setattr(check_command, "_compare", compare)
    common = ["--model", str(original), "--expected", str(path), "--no-compile"]
    code, _, err = run_check(capsys, *common, "--divergence-difference-tol", "0")
    assert code == 0 and seen == [0.0], err  # 0: every divergence fails (the rule is difference < tol)
    for args, message in ((["--divergence-difference-tol", "inf"], "(inf) must be a finite number >= 0"),
                          (["--divergence-difference-tol", "nan"], "(nan) must be a finite number >= 0"),
                          (["--divergence-difference-tol", "-1"], "(-1.0) must be a finite number >= 0"),
                          (["--atol", "inf"], "(inf) must be a finite number >= 0"),
                          (["--tol-map", ""], "has no entries")):
        code, report, err = run_check(capsys, *common, *args)
        message = message if args[0] == "--tol-map" else f"{args[0]} {message}"
        assert code == 2 and report is None and message in err, (args, err)
    assert seen == [0.0]


BENCH_ARGS = ["--tp", "2", "--batch-size", "2", "--prompt-len", "8", "--max-new-tokens", "5", "--warmup", "1",
              "--json"]
BENCH_RUNS = 3


@pytest.mark.slow
def test_bench_json_report_via_cli(models, ray_address):
    # --no-compile: the command's report through Ray and its stdout are the subject; bench passes
    # the flag on to the same Launcher as generate, whose compiled graphs other tests check
    original, _ = models
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "bench", "--model", str(original), *BENCH_ARGS, "--runs", str(BENCH_RUNS),
         "--ray-address", ray_address, "--no-compile"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the whole stdout is one JSON object
    assert report["config"]["compile"] is False
    check_bench_report(report)


def test_bench_json_report_in_process(models, capsys, in_process_cluster):
    original, _ = models
    capsys.readouterr()
    code = main(["bench", "--model", str(original), *BENCH_ARGS, "--runs", str(BENCH_RUNS), "--no-compile",
                 "--seq-len", "64", "--quiet"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)  # the whole stdout is one JSON object
    assert report["config"]["compile"] is False and report["config"]["seq_len"] == 64
    assert report["config"]["kv_cache_dtype"] is None and report["config"]["quantization"] is None
    assert report["config"]["moe_sharding"] is None and report["config"]["fused_projections"] is False
    check_bench_report(report)


def test_bench_json_records_the_kv_cache_dtype_and_the_weights_quantization(models, capsys, tmp_path,
                                                                            in_process_cluster):
    """Two runs differing only in these gave JSON that read alike (check's report had them)."""
    from shardlib.quantize_checkpoint import quantize_checkpoint

    quantized = quantize_checkpoint(models[0], tmp_path / "q8", "int8")
    capsys.readouterr()
    code = main(["bench", "--model", str(quantized), *BENCH_ARGS, "--runs", "1", "--no-compile", "--seq-len", "64",
                 "--kv-cache-dtype", "f8e4m3", "--quiet"])
    out = capsys.readouterr()
    assert code == 0, out.err
    config = json.loads(out.out)["config"]
    assert config["kv_cache_dtype"] == "f8e4m3" and config["quantization"]["quantization_dtype"] == "int8", config
    # and the table's title says them (it read as a float32 run's), and eager steps
    from launcher.cli.bench_command import table_title

    assert table_title(config).startswith("corelaunch bench: tp 2 (cpu, float32, int8 weights, f8e4m3 KV cache, eager), "
                                          "batch 2 x "), table_title(config)
    plain = {**config, "quantization": None, "kv_cache_dtype": None, "compile": True}
    assert table_title(plain).startswith("corelaunch bench: tp 2 (cpu, float32), batch 2 x "), table_title(plain)
    # check's verdict line says them the same way (it named neither the int8 weights nor the fp8 cache)
    checked = {"mode": "token-matching", "passed": True, "tp_degree": 2, "kv_strategy": "shard", "backend": "cpu",
               "dtype": "float32", "model": "q", "reference": "r", "num_tokens": 1, "prompts": [],
               **{k: config[k] for k in ("quantization", "kv_cache_dtype", "compile")}}
    assert format_report(checked).splitlines()[0] == (
        "token-matching PASSED: corelaunch tp 2 (shard KV heads, cpu, float32, int8 weights, f8e4m3 KV cache, eager) on q")


def test_bench_runs_a_batch_above_the_default_row_count_as_one(models, capsys, in_process_cluster, monkeypatch):
    """--batch-size 10 (the serving engine's default is 8 rows and a 2048-token prefill budget):
    every prompt holds a row and is prefilled in the first step, or the first result's times (which
    the report multiplies by the batch) would be those of a smaller batch."""
    from launcher.api import Launcher

    original, _ = models
    configs = []
    prepare = Launcher.prepare

    def recording(self):
        configs.append(self.config)
        return prepare(self)

    monkeypatch.setattr(Launcher, "prepare", recording)
    capsys.readouterr()
    code = main(["bench", "--model", str(original), "--tp", "1", "--batch-size", "10", "--prompt-len", "300",
                 "--max-new-tokens", "2", "--warmup", "0", "--runs", "1", "--no-compile", "--seq-len", "320",
                 "--quiet", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert configs and all(c.max_num_seqs == 10 and c.max_prefill_tokens == 3000 and c.max_batch_size == 0
                           for c in configs), configs
    assert json.loads(out.out)["context_encoding_model"]["count"] == 1


def check_bench_report(report: dict) -> None:
    runs = BENCH_RUNS
    assert report["config"]["tp_degree"] == 2 and report["config"]["runs"] == runs
    counts = {"e2e_model": runs, "context_encoding_model": runs, "token_generation_model": runs * (5 - 1)}
    for name, count in counts.items():
        section = report[name]
        ordered = [section[f"latency_ms_p{p}"] for p in (50, 90, 95, 99, 100)]
        assert ordered == sorted(ordered) and ordered[0] > 0, (name, section)
        assert 0 < section["latency_ms_avg"] <= section["latency_ms_p100"]
        assert section["count"] == count and section["throughput"] > 0
    e2e, ctx, tkg = report["e2e_model"], report["context_encoding_model"], report["token_generation_model"]
    assert ctx["latency_ms_p100"] <= e2e["latency_ms_p100"]  # prefill is part of each call
    # throughput definitions: 2 rows x 5 tokens per call; 2 x 8 prompt tokens; 2 tokens per step
    assert e2e["throughput"] == pytest.approx(2 * 5 / (e2e["latency_ms_avg"] / 1000), rel=1e-6)
    assert ctx["throughput"] == pytest.approx(2 * 8 / (ctx["latency_ms_avg"] / 1000), rel=1e-6)
    assert tkg["throughput"] == pytest.approx(2 / (tkg["latency_ms_avg"] / 1000), rel=1e-6)


def test_bench_counts_only_the_decode_steps_of_the_whole_batch():
    """Past the prefill budget the batch is prefilled over several steps: the first row's steps that
    prefilled the others (seconds each) were reported as decode steps of the whole batch."""
    from types import SimpleNamespace

    from launcher.cli.bench_command import full_batch_decode_steps

    # the leader's token times: rows 1 and 2 are prefilled by the 2-second steps that row 0 decodes in
    staggered = [SimpleNamespace(token_times_s=[1.0, 3.0, 5.0, 5.1, 5.2, 5.3], resumed_at=[]),
                 SimpleNamespace(token_times_s=[3.0, 5.0, 5.1, 5.2, 5.3, 5.4], resumed_at=[]),
                 SimpleNamespace(token_times_s=[5.0, 5.1, 5.2, 5.3, 5.4, 5.5], resumed_at=[])]
    assert full_batch_decode_steps(staggered) == pytest.approx([0.1, 0.1, 0.1])
    together = [SimpleNamespace(token_times_s=[1.0, 1.2, 1.3, 1.4], resumed_at=[]) for _ in range(3)]  # one step chose every row's
    assert full_batch_decode_steps(together) == pytest.approx([0.2, 0.1, 0.1])


def test_bench_leaves_a_restart_out_of_the_whole_batchs_decode_steps():
    """A TP group restarted mid-run: the rows resume at token 4 on the new rank 0's clock (here
    another host's, 100 s behind), and the gap into it was a decode step (-99.8 s: the report then
    refused its latencies after every run had run; on one host, seconds in p99/p100). The resumed
    rows are prefilled again over several steps: only the steps after the last one's are the batch's."""
    from types import SimpleNamespace

    from launcher.cli.bench_command import full_batch_decode_steps

    rows = [SimpleNamespace(token_times_s=[1.0, 3.0, 5.0, 5.1, -94.7, -94.6, -94.5, -94.4], resumed_at=[4]),
            SimpleNamespace(token_times_s=[3.0, 5.0, 5.1, 5.2, -94.6, -94.5, -94.4], resumed_at=[4]),
            SimpleNamespace(token_times_s=[5.0, 5.1, 5.2, 5.3, -94.5, -94.4], resumed_at=[4])]
    assert full_batch_decode_steps(rows) == pytest.approx([0.1, 0.1])  # 5.0 -> 5.1, -94.5 -> -94.4
    # a restart before a row's first token: that row's first attempt chose nothing
    late = [SimpleNamespace(token_times_s=[1.0, 1.1, 8.0, 8.1, 8.2], resumed_at=[2]),
            SimpleNamespace(token_times_s=[8.0, 8.1, 8.2], resumed_at=[0])]
    assert full_batch_decode_steps(late) == pytest.approx([0.1, 0.1])


def test_bench_times_context_encoding_from_the_calls_first_submission():
    """Each row's time_to_first_token_s counts from its own submission: the largest of them left out
    the time between the first row's submission and the later rows' (README: "from its submission at
    the driver")."""
    from types import SimpleNamespace

    from launcher.cli.bench_command import context_encoding_s

    rows = [SimpleNamespace(submitted_at_s=10.0, time_to_first_token_s=0.3),  # first token at 10.3
            SimpleNamespace(submitted_at_s=10.5, time_to_first_token_s=0.4)]  # at 10.9: the call's last
    assert context_encoding_s(rows) == pytest.approx(0.9)


def test_a_run_too_fast_to_time_reports_null_throughput_and_valid_json(capsys):
    """Latencies that sum to 0 (below the clock's resolution) gave throughput inf, which json.dumps
    writes as `Infinity`, no JSON reader's number."""
    from launcher.cli.bench_command import _print_table
    from shardlib.evaluation.bench_report import RunTiming, build_report

    report = build_report([RunTiming(e2e_s=0.5, time_to_first_token_s=0.0, decode_step_latencies_s=[0.0, 0.0],
                                     generated_tokens=6)], batch_size=2, prompt_len=8)
    assert report["context_encoding_model"]["throughput"] is None
    assert report["token_generation_model"]["throughput"] is None
    assert json.loads(json.dumps(report, allow_nan=False))["e2e_model"]["throughput"] == pytest.approx(12.0)
    config = {"backend": "cpu", "dtype": "float32", "compile": True, "quantization": None, "kv_cache_dtype": None,
              "tp_degree": 1, "batch_size": 2, "prompt_len": 8, "max_new_tokens": 3, "runs": 1, "warmup": 0}
    _print_table({**report, "config": config})
    assert "n/a prompt tokens/s" in capsys.readouterr().out


def test_bench_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "launcher", "bench", "--max-new-tokens", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-new-tokens (1) must be at least 2" in proc.stderr


def test_bench_refuses_a_prompt_longer_than_the_context_before_ray_starts(models, capsys, ray_tripwire):
    """It was refused only after Ray had started and every rank had loaded its shard."""
    original, _ = models
    capsys.readouterr()
    code = main(["bench", "--model", str(original), "--tp", "2", "--prompt-len", "100000", "--no-compile", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--prompt-len 100000 with --max-new-tokens 64 needs 100064 positions" in err
    assert "max_position_embeddings is 512" in err, err
    # under --seq-len the advice names bench's own flag
    code = main(["bench", "--model", str(original), "--tp", "2", "--prompt-len", "60", "--seq-len", "64",
                 "--no-compile", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "needs 124 positions but seq_len is 64" in err, err
    assert "raise seq_len (--seq-len 124, at most 512 for this model)" in err, err
    # past the model's own limit no --seq-len holds it: that advice was refused when followed
    code = main(["bench", "--model", str(original), "--tp", "2", "--prompt-len", "500", "--seq-len", "64",
                 "--no-compile", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "needs 564 positions but the model's max_position_embeddings is 512" in err, err
    assert "--seq-len" not in err, err
    # a batch too large for the host: its rows are bench's --batch-size (it has no --max-num-seqs)
    code = main(["bench", "--model", str(original), "--tp", "1", "--batch-size", "100000000", "--prompt-len", "8",
                 "--max-new-tokens", "4", "--no-compile", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "a smaller --batch-size (at most " in err and "--max-num-seqs" not in err, err
    assert "(--batch-size 100000000: 100000001 serving rows with the scratch row" in err, err
    assert "batch_size" not in err, err  # bench plans no static row (it had one, named by no bench option)
    # a shorter sequence length that fits the memory but not the run's 12 positions is no way out
    # (it was offered, "a smaller seq_len (at most 1 ...)", and refused when followed)
    assert "seq_len (at most" not in err and "--seq-len (at most" not in err, err
    from launcher.cli.bench_command import in_bench_terms

    planner_text = ("ways out: a smaller seq_len (at most 900 at 301 serving rows); fewer serving rows "
                    "(--max-num-seqs at most 115)")
    assert in_bench_terms(planner_text, 192) == ("ways out: a smaller --seq-len (at most 900 at --batch-size 300: "
                                                 "301 serving rows with the scratch row); a smaller --batch-size "
                                                 "(at most 115)")
    assert in_bench_terms(planner_text, 1000) == "ways out: a smaller --batch-size (at most 115)"


def test_bench_refuses_before_starting_a_run_with_no_step_decoding_the_whole_batch(models, capsys, ray_tripwire):
    """A review: 40 x 420 prompt tokens, past the 16384 a step, are prefilled over 2 steps, and with 2
    new tokens the first rows ended before the last one decoded: every run ran, then the report was
    refused for want of a decode step to time."""
    from launcher.cli import main

    original, _ = models
    base = ["bench", "--model", str(original), "--tp", "1", "--batch-size", "40", "--prompt-len", "420", "--warmup",
            "0", "--runs", "1", "--no-compile", "--seq-len", "430", "--quiet"]
    assert main([*base, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert ("--max-new-tokens 2 leaves no step that decodes the whole batch: its 16800 prompt tokens (--batch-size 40 "
            "x --prompt-len 420) are prefilled over 2 steps of at most 16384") in err, err
    assert "pass --max-new-tokens 3 or more" in err, err


def test_commands_without_nodes_offer_no_nodes_and_name_tp_as_their_flag(tmp_path, capsys, ray_tripwire):
    """bench, check and compile take no --nodes, yet their plan refusals offered "more nodes:
    --nodes 3 fits" (followed, it met "unrecognized arguments"), and named the planner's tp_degree
    where generate says --tp. trn1.2xlarge: its cores' memory, not this host's, decides the plan."""
    from launcher.cli.options import without_nodes_ways
    from shardlib.demo_model import ensure_demo_model

    original = ensure_demo_model()  # SmolLM2-135M: 9 heads, 3 KV heads
    too_big = ["--model", str(original), "--instance", "trn1.2xlarge", "--seq-len", "200", "--no-compile", "--quiet"]
    plan_text = ("ways out: a smaller seq_len (at most 107 at batch_size 3000 + 9 serving rows); a lower-precision "
                 "dtype: bfloat16 fits at tp 1; more nodes: --nodes 3 fits at tp 3")
    assert main(["plan", *too_big[:-2], "--batch-size", "3000"]) == 2  # the planner offers more nodes ...
    assert "more nodes: --nodes" in capsys.readouterr().out
    for command in (["bench", *too_big, "--batch-size", "3000", "--prompt-len", "16", "--max-new-tokens", "8"],
                    ["compile", *too_big[:-2], "--quiet", "--max-batch-size", "3000", "--out", str(tmp_path / "c")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "ways out: a smaller --seq-len" in err and "a lower-precision dtype: bfloat16 fits at tp 1" in err, err
        assert "--nodes" not in err and "no --tp passes every rule" in err, err
        assert not re.search(r"(?<!_)tp_degree", err), err  # (the error code no_valid_tp_degree stays)
    assert main(["check", "--model", str(original), "--tp", "2", "--no-compile", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is not divisible by --tp (2)" in err and not re.search(r"(?<!_)tp_degree", err), err
    # ... and where more nodes were the only way, that is said
    assert without_nodes_ways(plan_text, "bench") == ("ways out: a smaller seq_len (at most 107 at batch_size 3000 + 9 "
                                                      "serving rows); a lower-precision dtype: bfloat16 fits at tp 1")
    assert without_nodes_ways("needs 9 GiB; ways out: more nodes: --nodes 2 fits at tp 2, 4", "check") == (
        "needs 9 GiB; ways out: only more nodes, which `corelaunch check` does not take (`corelaunch generate` does: "
        "--nodes)")


def test_bench_refuses_a_long_prompt_len_before_building_the_prompts(models, capsys, monkeypatch, ray_tripwire):
    """--prompt-len 10**9 built a billion random ids (memory exhausted) before the length was checked."""
    from launcher.cli import bench_command

    def must_not_run(*args, **kwargs):
        raise AssertionError("bench built the random prompts before checking --prompt-len")

    monkeypatch.setattr(bench_command, "random_prompts", must_not_run)
    original, _ = models
    capsys.readouterr()
    code = main(["bench", "--model", str(original), "--tp", "2", "--prompt-len", str(10**9), "--max-new-tokens", "4",
                 "--no-compile", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--prompt-len 1000000000 with --max-new-tokens 4 needs 1000000004 positions but the " \
        "model's max_position_embeddings is 512: lower --prompt-len" in err, err


@pytest.mark.slow
def test_smollm2_logit_matching_passes_at_tp3(capsys, ray_session):
    """The README's example (the demo model, its default prompt) and SmolLM2 saying "Paris" at TP 3:
    one TP 3 launch checks both (tests/test_smollm2_e2e.py says "Paris" at TP 1, compiled). Eager
    (--no-compile): three ranks compiling SmolLM2's graphs on two cores was most of this test's
    time, and the compiled check path is the TP 2 Ray test's above (compiled TP 3 groups:
    tests/test_compiled.py)."""
    from transformers import AutoTokenizer

    from launcher.cli.check_command import DEFAULT_PROMPT
    from shardlib.demo_model import ensure_demo_model

    code, report, err = run_check(capsys, "--mode", "logit-matching", "--tp", "3", "--num-tokens", "8",
                                  "--no-compile", DEFAULT_PROMPT, "The capital of France is")
    assert code == 0, err
    meaning, france = report["prompts"]
    assert report["tp_degree"] == 3 and report["compile"] is False
    assert meaning["prompt"] == "I believe the meaning of life is"
    for p in (meaning, france):
        assert p["passed"] and p["first_pass_tokens"] == p["expected_tokens"]  # transformers' greedy tokens
        assert p["top_k"]["top5"]["max_abs_error"] < 1e-3
    text = AutoTokenizer.from_pretrained(ensure_demo_model()).decode(france["first_pass_tokens"])
    assert text.lstrip().startswith("Paris"), text


@pytest.mark.parametrize("command", ["generate", "check", "bench", "compile"])
def test_a_valid_run_whose_ranks_fail_exits_3_not_2(models, capsys, monkeypatch, in_process_cluster, command,
                                                    tmp_path):
    """A rank that dies while the run works is the cluster's failure, not bad input (2) and, for
    check, not an accuracy failure (1): every group the run starts (restarts too) loses a rank."""
    from launcher.cluster import tp_group
    from launcher.errors import WorkerDied

    build = tp_group.TPGroup  # in_process_cluster's ThreadTPGroup factory

    def failing_group(*args, **kwargs):
        group = build(*args, **kwargs)
        group.fail_next(WorkerDied("rank 1 (in-process) died while working"))
        if command == "compile":  # compile's ranks fail while they load and build the graphs

            def load(spec):
                raise WorkerDied("rank 1 (in-process) died while working")

            group.load = load
        return group

    monkeypatch.setattr(tp_group, "TPGroup", failing_group)
    from tests.test_compile_cli import save_word_tokenizer

    original = shutil.copytree(models[0], tmp_path / "model")
    save_word_tokenizer(original)  # generate takes text
    model = ["--model", str(original), "--tp", "2", "--no-compile", "--quiet"]
    argv = {"generate": ["generate", *model, "--max-new-tokens", "4", "--prompt", "hello"],
            "check": ["check", *model, "--prompt-ids", PROMPT_IDS, "--num-tokens", "4"],
            "bench": ["bench", *model, "--batch-size", "2", "--prompt-len", "8", "--max-new-tokens", "4",
                      "--warmup", "0", "--runs", "1", "--seq-len", "64"],
            "compile": ["compile", "--model", str(original), "--tp", "2", "--quiet", "--out", str(tmp_path / "out"),
                        "--seq-len", "64"]}[command]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 3 and "died while working" in err, (code, err)


@pytest.mark.parametrize("command", ["check", "bench", "compile"])
def test_rays_messages_during_a_json_run_stay_off_stdout(models, capsys, monkeypatch, in_process_cluster, command,
                                                        tmp_path):
    """A rank killed during `check --json` or `bench --json` made Ray's driver print "(raylet) A worker
    died ..." on stdout before the JSON object (generate and serve had the guard; these did not).
    Here the first group started prints such a message, as Ray's listener thread does, and fails
    with its first requests: bench's report counts the restart during its measured runs and warns of it."""
    from ray._private.worker import print_to_stdstream

    from launcher.cluster import tp_group
    from launcher.errors import WorkerDied

    build, started = tp_group.TPGroup, []

    def noisy_group(*args, **kwargs):
        group = build(*args, **kwargs)
        # a text of its own per command and group: Ray's driver drops a line it has printed before
        print_to_stdstream({"lines": [f"A worker died or was killed while executing a {command} task, "
                                      f"{'first' if not started else 'then another'}"],
                            "pid": "raylet", "is_err": False}, ignore_prefix=False)
        if command == "compile":  # its ranks fail as they load: no graphs compiled in this process (dynamo's
            def load(spec):  # recompile limit, shared by every in-process compile of a pytest worker)
                raise WorkerDied("rank 0 (in-process) died while loading")

            group.load = load
        elif not started:  # fails once its first requests run (bench: measured ones)
            submit = group.submit

            def submit_then_fail(requests):
                submit(requests)
                group.fail_next(WorkerDied("rank 0 (in-process) died while working"))

            group.submit = submit_then_fail
        started.append(group)
        return group

    monkeypatch.setattr(tp_group, "TPGroup", noisy_group)
    model = ["--model", str(models[0]), "--tp", "1", "--no-compile", "--quiet", "--json"]
    argv = {"check": ["check", *model, "--prompt-ids", PROMPT_IDS, "--num-tokens", "4"],
            "bench": ["bench", *model, "--batch-size", "2", "--prompt-len", "8", "--max-new-tokens", "4",
                      "--warmup", "0", "--runs", "1", "--seq-len", "64"],
            "compile": ["compile", "--model", str(models[0]), "--tp", "1", "--quiet", "--json", "--out",
                        str(tmp_path / "out"), "--buckets", "16", "--seq-len", "16"]}[command]
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    assert "A worker died or was killed" in out.err
    if command == "compile":  # the run fails (exit 3): stdout stays empty, Ray's line is on stderr
        assert code == 3 and out.out == "" and "died while loading" in out.err, (code, out)
        return
    assert code == 0, out.err
    report = json.loads(out.out)  # the whole stdout is one JSON object
    assert len(started) == 2  # the first group failed and was replaced
    if command == "bench":
        assert report["group_restarts"] == 1
        assert "the TP group failed and was restarted 1 time(s) during the measured runs" in out.err


def test_the_text_report_shows_an_infinite_divergence_as_inf():
    """A divergence at a token corelaunch gave -inf is null in the JSON (strict JSON has no
    infinity); the text report formatted that null as a number and crashed (exit 1, "failed")."""
    from shardlib.evaluation.accuracy import logit_matching

    expected = torch.zeros(2, 8)
    expected[:, 3] = 5.0

    def generate(ids, m):
        actual = expected[len(ids) - 1:][:m].clone()
        actual[0, 3] = -math.inf  # corelaunch forbids the expected token
        return [int(t) for t in actual.argmax(dim=-1)], actual

    result = logit_matching([1], expected, generate).to_dict()
    report = {"mode": "logit-matching", "passed": False, "tp_degree": 1, "kv_strategy": "shard", "backend": "cpu",
              "dtype": "float32", "model": "m", "reference": "r", "num_tokens": 2,
              "tol_map": {"top5": {"atol": 1e-5, "rtol": 0.01}}, "divergence_difference_tol": 0.001,
              "prompts": [{**result, "prompt": None, "input_ids": [1]}]}
    text = format_report(report)
    assert "max(actual) - actual[expected] = not finite (FAILS)" in text, text


def test_exit_codes_tell_bad_input_from_a_failed_run():
    from launcher.cli.exit_codes import exit_code_for
    from launcher.errors import PlacementImpossible, PlacementTimeout, WorkerDied

    assert exit_code_for(PlacementImpossible("never fits")) == 2  # the same command fails the same way
    assert exit_code_for(PlacementTimeout("busy cluster")) == 3
    assert exit_code_for(WorkerDied("rank 1 died")) == 3
    assert exit_code_for(ConnectionResetError("peer gone")) == 3  # an OSError, but not a file it cannot use
    assert exit_code_for(TimeoutError("a lock held too long")) == 3
    assert exit_code_for(PermissionError(13, "denied", "/x")) == 2
    assert exit_code_for(ValueError("bad value")) == 2


def test_check_whose_report_reader_goes_away_exits_141_like_every_command(models, capsys, monkeypatch):
    """BrokenPipeError is an OSError: check's catch of OSError (files it cannot use) turned a closed
    pipe into a bad-input message and exit 2; it must reach launcher.cli.run, which exits 141 when
    stdout's reader is gone."""
    import launcher.cli.check_command as check_command

    def closed_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(check_command, "_run", closed_pipe)
    original, _ = models
    with pytest.raises(BrokenPipeError):
        main(["check", "--model", str(original), "--prompt-ids", PROMPT_IDS])


@pytest.mark.parametrize("command", ["generate", "bench", "compile"])
def test_a_lock_held_too_long_or_a_closed_pipe_is_no_traceback(command, capsys, monkeypatch):
    """generate and bench caught no OSError and compile re-raised most: a lock another process held
    too long (the demo model's conversion) ended in a traceback and exit 1, not the run failure (3)."""
    import launcher.api
    import launcher.cli.bench_command as bench_command
    import launcher.cli.compile_command as compile_command

    def raising(error):
        def fail(*args, **kwargs):
            raise error
        return fail

    for error, expected in ((TimeoutError("waited 600 s for another process converting the demo model"), 3),
                            (BrokenPipeError(32, "Broken pipe"), None)):
        monkeypatch.setattr(launcher.api, "Launcher", raising(error))
        monkeypatch.setattr(bench_command, "_bench", raising(error))
        monkeypatch.setattr(compile_command, "compile_model", raising(error))
        argv = {"generate": ["generate", "hello"], "bench": ["bench"],
                "compile": ["compile", "--out", "/tmp/corelaunch-never-written"]}[command]
        capsys.readouterr()
        if expected is None:  # reaches launcher.cli.run, which exits 141 when stdout's reader is gone
            with pytest.raises(BrokenPipeError):
                main(argv)
            continue
        assert main(argv) == expected
        assert capsys.readouterr().err.startswith(f"corelaunch {command}: waited 600 s")
