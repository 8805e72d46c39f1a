"""Command-line refusals said in the command's own words: an API value's range named by its flag,
the API's advice translated to the flag that does it, the user's own quoted values left as typed,
and options an eager run (--no-compile) would ignore refused before anything starts."""

from __future__ import annotations

import pytest

from launcher.cli import main

MISSING_MODEL = "/nonexistent/corelaunch-model"  # a refusal after the options' checks would name it


def refusal(capsys, *argv: str) -> str:
    """The one-line refusal `corelaunch ARGV` prints (exit code 2 asserted)."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_an_out_of_range_seed_is_named_by_its_flag(capsys, ray_tripwire):
    """It read "seed=... must be None or an integer ...": the API's field, and a None nobody can type."""
    err = refusal(capsys, "generate", "--model", MISSING_MODEL, "--seed", "99999999999999999999999",
                  "--temperature", "1", "Hi")
    assert err == "corelaunch generate: --seed 99999999999999999999999 must be an integer in [-2**63, 2**63 - 1]\n"


def test_a_schema_that_is_no_object_points_at_the_json_object_flag(capsys, ray_tripwire):
    """It ended "for any JSON object use json_object=True", the driver API's keyword."""
    err = refusal(capsys, "generate", "--model", MISSING_MODEL, "--json-schema", "[1,2]", "Hi")
    assert err.startswith("corelaunch generate: --json-schema: json schema [1, 2] must be a JSON object"), err
    assert err.endswith("; for any JSON object use --json-object\n") and "json_object" not in err, err


def test_the_driver_api_keeps_its_own_advice():
    from shardlib.structured_output import StructuredOutput

    with pytest.raises(ValueError, match=r"for any JSON object use json_object=True$"):
        StructuredOutput(json="[1, 2]")


def test_a_users_quoted_value_is_quoted_back_exactly(capsys, ray_tripwire):
    """The flag wording rewrote words inside the user's own pattern: `--regex 'the seq_len is ([0-9]+'`
    came back as "the --seq-len is ([0-9]+"."""
    err = refusal(capsys, "generate", "--model", MISSING_MODEL, "--regex", "the seq_len is ([0-9]+", "Hi")
    assert err.startswith("corelaunch generate: --regex (regex 'the seq_len is ([0-9]+') cannot be used"), err
    assert "--seq-len" not in err, err


@pytest.mark.parametrize("message, said", [
    # the user's values, in either quote, stay as typed; the message's own words outside them are flags
    ("regex 'the seq_len is (' bad; seq_len is 8", "regex 'the seq_len is (' bad; --seq-len is 8"),
    ('choice "it\'s max_new_tokens" bad; max_new_tokens 3', 'choice "it\'s max_new_tokens" bad; --max-new-tokens 3'),
    # an apostrophe inside a word opens no quoted span
    ("the model's seq_len is 4096 and the request's max_new_tokens 9",
     "the model's --seq-len is 4096 and the request's --max-new-tokens 9"),
    ("for any JSON object use json_object=True", "for any JSON object use --json-object"),
    ("a pattern 'json_object=True' of the user's", "a pattern 'json_object=True' of the user's"),
])
def test_generate_wording_skips_quoted_spans(message, said):
    from launcher.cli.options import in_generate_flags

    assert in_generate_flags(message) == said


@pytest.mark.parametrize("flags, said", [
    (["--warm-up"], "--warm-up (True) builds every compiled graph while starting, and compile is False "
                    "(--no-compile), which runs eagerly and builds none: drop one of them"),
    (["--max-context-length", "64"],
     "--max-context-length (64) sets the largest context-encoding bucket, and compile is False (--no-compile) with "
     "no bucket list, which runs each prompt at its exact length: drop one of them, or give a bucket list "
     "(--context-buckets, --token-buckets) to run eagerly at bucket lengths"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_options_an_eager_run_ignores_are_refused_as_granularity_is(command, flags, said, capsys, ray_tripwire):
    """--warm-up and --max-context-length (without a bucket list) did nothing under --no-compile, silently,
    while --granularity there is refused."""
    argv = [command, "--no-compile", *flags] + (["Hi"] if command == "generate" else [])
    assert refusal(capsys, *argv) == f"corelaunch {command}: {said}\n"


def test_the_driver_api_refuses_them_in_its_own_words():
    from launcher.api import LaunchConfig

    with pytest.raises(ValueError, match=r"^warm_up \(True\) builds every compiled graph .* compile is False"):
        LaunchConfig(compile=False, warm_up=True)
    with pytest.raises(ValueError, match=r"^max_context_length \(64\) sets the largest context-encoding bucket"):
        LaunchConfig(compile=False, max_context_length=64)


@pytest.mark.parametrize("lists", [dict(context_buckets=(32, 64)), dict(token_buckets=(128,)),
                                   dict(context_buckets=(32,), token_buckets=(128,))])
def test_max_context_length_with_a_bucket_list_still_runs_eagerly(lists):
    """With a bucket list an eager run is bucketed (launch_buckets), and --max-context-length caps its
    context buckets: taken, not refused."""
    from launcher.api import LaunchConfig

    assert LaunchConfig(compile=False, max_context_length=64, **lists).max_context_length == 64
    assert LaunchConfig(compile=True, warm_up=True, max_context_length=64).warm_up  # compiled: both are used


@pytest.mark.parametrize("given", ["--presharded", "--compiled"])
def test_a_presharded_cache_beside_weights_already_presharded_is_refused(capsys, ray_tripwire, tmp_path, given):
    """--presharded-cache with --presharded or --compiled was ignored without a word: those already
    load pre-sharded weights, and no copy was ever written."""
    said = refusal(capsys, "generate", "--presharded-cache", given, str(tmp_path), "--model", MISSING_MODEL, "Hi")
    assert "--presharded-cache (True)" in said and f"{given} (" in said and "drop one of them" in said, said


def test_the_driver_api_refuses_a_presharded_cache_beside_a_presharded_directory(tmp_path):
    from launcher.api import LaunchConfig

    with pytest.raises(ValueError, match=r"presharded_cache \(True\).*presharded_dir"):
        LaunchConfig(presharded_cache=True, presharded_dir=str(tmp_path))


def test_quantize_without_model_says_why_the_demo_model_lock_wait_failed(capsys, tmp_path, monkeypatch):
    """The demo model's conversion lock held past its wait raised TimeoutError (an OSError): a
    traceback after 600 s, where generate and check print the message. The lock is held for real
    here; only the wait is shortened."""
    from filelock import FileLock

    from shardlib import demo_model

    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_model, "LOCK_TIMEOUT_S", 0.2)
    (tmp_path / "cache").mkdir()
    with FileLock(str(tmp_path / "cache" / f"{demo_model.DEMO_MODEL_NAME}.lock")):
        err = refusal(capsys, "quantize", "--dtype", "int8", "--out", str(tmp_path / "q"))
    assert err.startswith("corelaunch quantize: waited 0.2 s for another process converting the demo model"), err
    assert not (tmp_path / "q").exists()


def test_quantize_into_a_parent_that_holds_no_new_folders_names_that_parent(capsys, tmp_path):
    """`--out /proc/q3` was refused naming '/proc/.q3.partial-...', a hidden folder the user never
    chose. (/proc, not a chmod-ed folder: the tests may run as root, whom no mode bit stops.)"""
    from tests.model_factory import save_random_model

    model = save_random_model(tmp_path / "model", num_heads=4, num_kv_heads=2, seed=3)
    err = refusal(capsys, "quantize", "--quiet", "--model", str(model), "--dtype", "int8",
                  "--out", "/proc/corelaunch-q3")
    assert err.startswith("corelaunch quantize: could not write --out /proc/corelaunch-q3 (its parent folder /proc "
                          "cannot hold new folders: "), err
    assert ".partial" not in err and err.endswith("; pass a new path in a directory you can write to\n"), err
