"""`corelaunch check` refusals that come before the reference or Ray runs: a prompt that is not
UTF-8, a path starting with an unexpanded `~`, a tolerance given to token matching (which has none);
an internal error that never reads as exit 1 (an accuracy failure); and a --save-expected write
interrupted midway that leaves no hidden partial file behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.cli import check_command, main
from tests.model_factory import save_random_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("check_refusals") / "model", num_heads=4, num_kv_heads=2, seed=3)


def run_check(capsys, *args: str) -> tuple[int, str, str]:
    """`corelaunch check --json --quiet ARGS` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(["check", "--json", "--quiet", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_prompt_that_is_not_utf8_is_refused_with_exit_2_not_a_traceback():
    """A Latin-1 argument reaches Python with a surrogate; the tokenizer failed on it with a TypeError
    traceback and exit 1, check's code for an accuracy failure, with nothing on stdout under --json."""
    proc = subprocess.run([sys.executable, "-m", "launcher", "check", "--json", "--quiet", "--num-tokens", "2",
                           b"caf\xe9"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == ("corelaunch check: prompt 0 is not valid UTF-8 text ('caf\\udce9': surrogates not allowed "
                           "at position 3); pass UTF-8 text\n"), proc.stderr


def test_an_internal_error_exits_3_not_1_which_means_the_check_failed(capsys, monkeypatch):
    def internal_error(args):
        raise TypeError("an internal fault")

    monkeypatch.setattr(check_command, "_run", internal_error)
    code, out, err = run_check(capsys, "--prompt-ids", "5")
    assert code == 3 and out == "", err
    assert "Traceback" in err and "corelaunch check: internal error (TypeError: an internal fault)" in err, err


@pytest.mark.parametrize("option, value", [("--save-expected", "~/corelaunch-expected.pt"),
                                           ("--expected", "~/corelaunch-expected.pt"),
                                           ("--reference", "~/corelaunch-reference")])
def test_a_path_with_an_unexpanded_home_is_refused_naming_its_option(option, value, model, capsys, tmp_path,
                                                                      monkeypatch, ray_tripwire):
    """`--save-expected=~/x.pt` (no shell expands that `~`) wrote a folder named `~` in the working directory."""
    monkeypatch.chdir(tmp_path)
    prompts = [] if option == "--expected" else ["--prompt-ids", "5"]
    code, out, err = run_check(capsys, "--model", str(model), "--num-tokens", "1", *prompts, f"{option}={value}")
    assert code == 2 and out == "", err
    assert err.startswith(f"corelaunch check: {option} {value} starts with a `~` that nothing expanded"), err
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("flag, value", [("--atol", "3"), ("--tol-map", "5:0.9"),
                                         ("--divergence-difference-tol", "7")])
def test_a_tolerance_given_to_token_matching_is_refused_not_ignored(flag, value, model, capsys, ray_tripwire):
    code, out, err = run_check(capsys, "--model", str(model), "--prompt-ids", "5", "--num-tokens", "1",
                               "--no-compile", "--mode", "token-matching", flag, value)
    assert code == 2 and out == "", err
    assert err == (f"corelaunch check: {flag} applies to --mode logit-matching, not token-matching: drop {flag}, "
                   f"or pass --mode logit-matching\n"), err


def test_tolerances_left_at_their_defaults_are_not_refused(model, capsys, tmp_path, monkeypatch, ray_tripwire):
    """The refusal above looks at what was given: token matching without tolerance flags runs, and
    logit matching takes --atol (its default, 1e-5, when not given)."""
    from shardlib.model_config import load_model_config

    path = tmp_path / "expected.pt"
    vocab = load_model_config(model).vocab_size
    torch.save({"input_ids": [[5, 17]], "expected_logits": torch.zeros(1, 2, vocab)}, path)
    seen = []

    def compare(args, launcher, model_dir, texts, prompts, expected, num_tokens, tol_map, progress):
        seen.append((args.mode, args.atol, {k: a for k, (a, _) in tol_map.items()}))
        return {"passed": True}

    monkeypatch.setattr(check_command, "_compare", compare)
    common = ["--model", str(model), "--expected", str(path), "--no-compile"]
    assert run_check(capsys, *common, "--mode", "token-matching")[0] == 0
    assert run_check(capsys, *common, "--atol", "3")[0] == 0
    (mode0, atol0, groups0), (mode1, atol1, groups1) = seen
    assert (mode0, atol0, mode1, atol1) == ("token-matching", 1e-5, "logit-matching", 3.0)
    assert set(groups0.values()) == {1e-5} and set(groups1.values()) == {3.0}


class InterruptedWhenSaved:
    """Stands for the logits of a save that Ctrl-C (or SIGTERM, raised as KeyboardInterrupt by the
    CLI) stops while torch.save writes them."""

    def __reduce_ex__(self, protocol):
        raise KeyboardInterrupt


def test_an_interrupted_save_expected_leaves_no_hidden_partial_file(tmp_path):
    expected = check_command.Expected([[1, 2, 3]], [[4, 5]], InterruptedWhenSaved(), "test")
    with pytest.raises(KeyboardInterrupt):
        check_command.save_expected(expected, str(tmp_path / "expected.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_finished_save_expected_leaves_only_its_file(tmp_path):
    """The other side of the clean-up: a save that completes keeps its file and nothing else."""
    expected = check_command.Expected([[1, 2, 3]], [[4, 5]], torch.zeros(1, 2, 8), "test")
    check_command.save_expected(expected, str(tmp_path / "expected.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expected.pt"]
    assert check_command.load_expected(str(tmp_path / "expected.pt")).tokens == [[4, 5]]
