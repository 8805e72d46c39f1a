"""Ray's messages kept off a command's stdout, and a command started with stdout closed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_rays_cluster_messages_go_to_stderr_while_a_command_runs_ray(capsys):
    """Ray's driver prints a cluster message (a worker that died, Serve's controller shut down) as
    its listener thread does, to whatever sys.stdout is: `generate --json` printed it before the
    JSON object, and `serve` after its ready line."""
    from ray._private.worker import print_to_stdstream

    from launcher.cli.command_stdout import ray_output_on_stderr

    message = {"lines": ["A worker died or was killed while executing a task"], "pid": "raylet", "is_err": False}
    with ray_output_on_stderr() as stdout:
        print_to_stdstream(message, ignore_prefix=False)  # what ray's listen_error_messages calls
        print('{"outputs": []}', file=stdout)
    out, err = capsys.readouterr()
    assert out == '{"outputs": []}\n' and "A worker died" in err
    outside = {**message, "lines": ["Task ServeController.graceful_shutdown failed"]}  # Ray drops repeats
    print_to_stdstream(outside, ignore_prefix=False)
    assert "graceful_shutdown" in capsys.readouterr().out  # Ray's own behaviour, which the block changes


def test_a_command_started_with_stdout_closed_says_so_without_a_traceback():
    """`corelaunch plan >&-` ended in an AttributeError traceback (exit 1), and `generate` ran the
    whole launch first and lost its output."""
    out = subprocess.run(f"{sys.executable} -m launcher plan >&-", shell=True, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "corelaunch: stdout is closed; run it with stdout open" in out.stderr


def test_a_benchmark_that_runs_ray_prints_its_report_alone_on_stdout(capsys):
    """benchmarks/replicas.py kills a rank on purpose, and Ray's "(raylet) A worker died" line came
    before its JSON report on stdout; every benchmark that runs Ray now runs its main this way."""
    import ast
    import json

    from ray._private.worker import print_to_stdstream

    from launcher.cli.command_stdout import run_reporting

    def main(out):
        print_to_stdstream({"lines": ["A worker died or was killed (a benchmark's planned kill)"], "pid": "raylet",
                            "is_err": False}, ignore_prefix=False)
        print(json.dumps({"ratio": 1.0}), file=out)

    run_reporting(main)
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ratio": 1.0} and "A worker died" in err
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        source = script.read_text()
        if "ray.init(" not in source and "Launcher(" not in source:
            continue
        entry = [node for node in ast.parse(source).body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        assert entry and "run_reporting(main)" in ast.unparse(entry[0]), f"{script.name} prints Ray's messages on stdout"


def test_a_benchmarks_help_goes_to_stdout():
    """argparse prints --help on sys.stdout, which run_reporting had made stderr: `serving.py --help |
    less` showed nothing."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tokenizer_lock.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--prompts" in done.stdout and "--prompts" not in done.stderr, done.stderr
