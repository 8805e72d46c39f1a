"""`corelaunch check` and `bench` take --cpus-per-rank, and a placement refusal names only ways out
the asking command has.

Inside a Ray job whose entrypoint holds a CPU of the node (`ray job submit --entrypoint-num-cpus 1`),
a cpu rank asking its node's CPUs / TP can never be placed; the refusal told check and bench users
to "lower --replicas, or give each rank fewer CPUs with --cpus-per-rank", and argparse refused both.
Also here: check's PROMPT positionals no longer take the value of an option check does not know, so
argparse's refusal names every word it left over.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import build_parser, main
from launcher.cluster.resources import explain_unplaceable

REPO = Path(__file__).resolve().parents[1]
RAY_JOB_FLAGS = {"--entrypoint-num-cpus"}
"""`ray job submit`'s own options, which a refusal names as the job's, not as the command's."""


def options_of(command: str) -> set[str]:
    """Every option string `corelaunch <command> --help` lists."""
    parser = build_parser().subcommand_parsers[command]
    return {option for action in parser._actions for option in action.option_strings}


def flags_named(message: str) -> set[str]:
    """The command-line options a message names (not a Ray job's own)."""
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", message)) - RAY_JOB_FLAGS


@pytest.mark.parametrize("command", ["check", "bench"])
def test_check_and_bench_take_cpus_per_rank(command):
    """The option the refusal names, on both commands (argparse refused it)."""
    assert "--cpus-per-rank" in options_of(command)
    args = build_parser().parse_args([command, "--cpus-per-rank", "1.5"])
    assert args.cpus_per_rank == 1.5


@pytest.mark.parametrize("command", ["check", "bench"])
def test_a_bad_cpus_per_rank_is_refused_by_name_before_ray_starts(command, capsys, ray_tripwire, tmp_path):
    """The value reaches LaunchConfig, whose check (the one generate's and serve's values pass) names
    the option; nothing starts."""
    from tests.model_factory import save_random_model

    model = save_random_model(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=3)
    extra = ["--prompt-ids", "5,17"] if command == "check" else ["--prompt-len", "4", "--max-new-tokens", "2"]
    code = main([command, "--model", str(model), "--tp", "1", "--no-compile", "--quiet", "--cpus-per-rank", "0",
                 *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"corelaunch {command}: --cpus-per-rank (0.0) must be a finite number of CPUs of at least" in err, err


def test_a_group_held_out_by_a_job_names_only_the_asking_commands_flags():
    """One replica whose CPUs a Ray job holds (as --entrypoint-num-cpus 1 holds one of 2): "lower
    --replicas" cannot help one group, and check, bench and compile have no --replicas."""
    why = explain_unplaceable({"CPU": 2.0}, 1, 1, [{"CPU": 2.0}], [{"CPU": 1.0}], ["n1"], groups=1)
    assert "other groups or jobs hold those resources" in why, why
    assert "--replicas" not in why, why
    assert why.endswith("Free them, add nodes, or give each rank fewer CPUs with --cpus-per-rank (by default a rank "
                        "takes its node's CPUs / TP; inside a Ray job, the job's own --entrypoint-num-cpus holds "
                        "some)"), why
    for command in ("check", "bench", "compile", "generate", "serve"):
        assert flags_named(why) <= options_of(command), (command, why)
    # several replicas of the launch's own: fewer of them is a way out (generate and serve take --replicas)
    several = explain_unplaceable({"CPU": 1.0}, 1, 1, [{"CPU": 1.0}] * 3, [{"CPU": 0.0}] * 3, ["a", "b", "c"], groups=3)
    assert "Free them, add nodes, lower --replicas, or give each rank fewer CPUs" in several, several
    # a device rank's bundle is fixed: no CPU share to lower
    device = explain_unplaceable({"neuron_cores": 1, "CPU": 1}, 1, 1, [{"CPU": 1.0, "neuron_cores": 1.0}],
                                 [{"CPU": 0.0, "neuron_cores": 0.0}], ["n1"])
    assert device.endswith("Free them or add nodes"), device


def test_more_nodes_per_group_is_offered_as_a_way_only_some_commands_take():
    """A group no one node holds but two do, at --nodes 1: check, bench and compile have no --nodes
    (argparse refuses it), so the way is told as the other commands'; a --nodes the user gave is
    their command's own."""
    why = explain_unplaceable({"CPU": 1.0}, 2, 1, [{"CPU": 1.0}, {"CPU": 1.0}], node_names=["n1", "n2"])
    assert ("allow more nodes per group (--nodes 2 holds it) where the command takes --nodes (check, bench and "
            "compile keep a group on one node)") in why, why
    assert flags_named(why) - {"--nodes"} <= options_of("check"), why
    given = explain_unplaceable({"CPU": 1.0}, 3, 2, [{"CPU": 1.0}] * 3, node_names=["n1", "n2", "n3"])
    assert "--nodes 3 holds it" in given and "where the command takes" not in given, given


def test_leftover_arguments_are_named_with_their_values(capsys):
    """check's and generate's PROMPT positionals took the first value after an option the command
    does not know, so argparse's refusal left it out ("unrecognized arguments: --bogus"); bench,
    without positionals, named them all."""
    for command, words, named in (("check", ["--bogus", "7"], "--bogus 7"),
                                  ("check", ["--tp", "1", "--bogus", "7", "8", "--json"], "--bogus 7"),
                                  ("check", ["--cpus-per-rank", "1", "--replicas", "1"], "--replicas 1"),
                                  ("check", ["--nodes", "2", "--replicas", "1"], "--nodes 2 --replicas 1"),
                                  ("check", ["a prompt", "--bogus", "-5"], "--bogus -5"),
                                  ("generate", ["--bogus", "7"], "--bogus 7"),
                                  # one value an unknown option (most take one), the words after it
                                  # prompts; the stray B is the last (argparse took the first run)
                                  ("generate", ["--bogus", "B", "A", "--max-new-tokens", "4", "B"], "--bogus B B"),
                                  # a known option's value equal to the stray one is the option's
                                  ("bench", ["--bogus", "2", "--tp", "2"], "--bogus 2"),
                                  ("generate", ["A", "--bogus", "4", "--max-new-tokens", "4"], "--bogus 4"),
                                  ("bench", ["--bogus", "7"], "--bogus 7")):
        with pytest.raises(SystemExit) as exit_:
            main([command, *words])
        err = capsys.readouterr().err
        assert exit_.value.code == 2
        assert f"corelaunch {command}: error: unrecognized arguments: {named} (see" in err, (words, err)
    # generate's split prompts keep their hint (no unknown option: nothing put back)
    with pytest.raises(SystemExit):
        main(["generate", "A", "--max-new-tokens", "4", "B"])
    assert "unrecognized arguments: B; prompts go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a negative number is a prompt to argparse: the same hint
        main(["generate", "A", "--max-new-tokens", "4", "-5"])
    assert "unrecognized arguments: -5; prompts go together" in capsys.readouterr().err
    # a negative number is a value to argparse (taken as a prompt here), not a prompt starting with '-'
    with pytest.raises(SystemExit):
        main(["generate", "--bogus", "-.5"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus -.5 (see" in err and "--prompt=" not in err, err
    # prompts as before: before the options, or after them and `--` (a prompt that starts with a dash)
    assert build_parser().parse_args(["check", "one", "two", "--tp", "1"]).prompts == ["one", "two"]
    assert build_parser().parse_args(["check", "--tp", "1", "--", "one", "--two"]).prompts == ["one", "--two"]


@pytest.fixture
def one_cpu_held(ray_session):
    """The session's Ray with one of its CPUs held by an actor, as a Ray job's entrypoint
    (--entrypoint-num-cpus 1) holds one of its node's; yields the Ray address."""
    ray = ray_session
    if ray.cluster_resources().get("CPU", 0) < 2:
        pytest.skip("needs a Ray of 2 CPUs or more: one held, one for the rank")

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> int:
            return 1

    holder = Holder.remote()
    ray.get(holder.ping.remote(), timeout=60)
    yield ray.get_runtime_context().gcs_address
    ray.kill(holder)


@pytest.mark.slow
def test_check_inside_a_job_holding_a_cpu_is_told_a_way_it_takes_and_places_with_it(tmp_path, one_cpu_held):
    """The README's Ray Jobs case, for check: the default share (all the node's CPUs at TP 1) waits
    out --placement-timeout, the refusal names only options `corelaunch check` takes, and
    --cpus-per-rank 1 places the group, whose check passes."""
    from tests.model_factory import save_random_model

    model = save_random_model(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=3)
    base = [sys.executable, "-m", "launcher", "check", "--model", str(model), "--tp", "1", "--no-compile",
            "--prompt-ids", "5,17,42,9", "--num-tokens", "4", "--mode", "token-matching", "--placement-timeout", "5",
            "--ray-address", one_cpu_held, "--quiet", "--json"]

    held = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert held.returncode == 3, held.stderr  # the run failed: nothing wrong with the input
    [refusal] = [line for line in held.stderr.splitlines() if line.startswith("corelaunch check: ")]
    assert "other groups or jobs hold those resources" in refusal, held.stderr
    assert "--cpus-per-rank" in refusal, refusal
    assert flags_named(refusal) <= options_of("check"), refusal

    placed = subprocess.run([*base, "--cpus-per-rank", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout)["passed"] is True
