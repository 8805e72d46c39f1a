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
