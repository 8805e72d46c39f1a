"""A cluster whose alive nodes have no CPUs (a head started with `ray start --head --num-cpus 0`, no
CPU worker alive yet): a cpu rank's even share was taken of one CPU that was not there (a tiny
fraction a rank), and the group waited out its placement timeout. Refused, naming --cpus-per-rank,
which still sizes the ranks where given."""

from __future__ import annotations

import pytest

from launcher.cli.exit_codes import EXIT_RUN_FAILED, exit_code_for
from launcher.cluster.resources import cpu_rank_resources, rank_resources
from launcher.errors import NoDeviceResource


@pytest.mark.parametrize("node_cpus", [[0.0], [0.0, 0.0], [], 0.0])
def test_no_cpu_on_any_alive_node_is_refused_naming_cpus_per_rank(node_cpus):
    with pytest.raises(NoDeviceResource) as refused:
        cpu_rank_resources(2, node_cpus, replicas=2)
    message = str(refused.value)
    assert "no alive node of the Ray cluster has any" in message and "--cpus-per-rank N" in message, message
    assert "`--num-cpus 0`" in message
    assert exit_code_for(refused.value) == EXIT_RUN_FAILED  # a CPU node may yet join: not bad input


def test_cpus_per_rank_given_still_sizes_the_ranks_and_device_ranks_take_one_cpu():
    assert cpu_rank_resources(2, [0.0], cpus_per_rank=2).bundle == {"CPU": 2}
    assert rank_resources("GPU", tp=2, node_cpus=[0.0]).bundle == {"GPU": 1, "CPU": 1}
    assert cpu_rank_resources(2, [0.0, 4.0]).bundle == {"CPU": 2}  # a CPU-less head beside a CPU worker


@pytest.mark.slow
def test_a_launch_on_a_cpu_less_head_is_refused_before_placement(tmp_path):
    """On a real cluster of one `--num-cpus 0` head: the launch asked for half a CPU a rank of a node
    that had none, and waited out --placement-timeout."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.model_factory import random_model_with_smollm2_tokenizer
    from tests.test_wrong_ray_token_refused_at_once import head_with_a_token

    model = random_model_with_smollm2_tokenizer(tmp_path)
    with head_with_a_token(num_cpus=0) as (address, env, token):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "launcher", "generate", "--ray-address", address, "--model", model,
                              "--tp", "1", "--replicas", "2", "--no-compile", "--placement-timeout", "60",
                              "--max-new-tokens", "2", "Hello"],
                             capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                             env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        seconds = time.monotonic() - started
    assert out.returncode == EXIT_RUN_FAILED, out.stderr[-3000:]
    assert "no alive node of the Ray cluster has any (CPUs per node: 0)" in out.stderr, out.stderr[-3000:]
    assert seconds < 60, seconds  # not the placement timeout
