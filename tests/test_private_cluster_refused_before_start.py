"""A private Ray cluster too small for the launch's cpu TP groups is refused before Ray starts: its one
node's CPUs are known beforehand (ray_cluster.private_cluster_cpus, what connect() gives Ray). The
launch started Ray and loaded the tokenizer (about 8 s on 2 cores) only to refuse the same.

Each command runs in a fresh process, with a Ray temp dir of its own (RAY_TMPDIR): a Ray session of
this test process would make the cluster a shared one, which is checked only after the connection.
tests/test_ray_connect_e2e.py covers `corelaunch generate`; here the driver API and `compile`, which
plan through the same launch_plan.plan_launch, and a cluster joined by address, which is not judged
by this host's CPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from launcher.cluster.resources import fewer_groups_why, never_placeable_why
from shardlib.host_cpus import host_cpus

REPO = Path(__file__).resolve().parents[1]
TOO_MANY_CPUS = str(4 * host_cpus())
WOULD_START = "the private Ray cluster this launch would start (this host alone)"

DRIVER_API = textwrap.dedent("""
    import sys
    from launcher.api import LaunchConfig, Launcher
    try:
        Launcher(LaunchConfig(ray_address="local", tp=1, cpus_per_rank=float(sys.argv[1]), compile=False,
                              progress=False)).start()
    except Exception as err:
        print(type(err).__name__, err, flush=True)
""")


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`python ARGS` from the repository with a Ray temp dir of its own; (result, the Ray sessions
    it left there: each ray.init that starts a node writes a session_* folder)."""
    with tempfile.TemporaryDirectory(prefix="clray", dir="/tmp") as tmp:  # short: Ray's socket paths
        env = {**os.environ, "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env,
                             cwd=REPO)
        return out, sorted(p.name for p in Path(tmp).rglob("session_*"))


def test_the_driver_api_refuses_a_private_cluster_too_small_before_starting_ray():
    out, sessions = _run(["-c", DRIVER_API, TOO_MANY_CPUS])
    assert out.stdout.startswith(f"PlacementImpossible {WOULD_START} cannot place a TP group"), out.stderr[-3000:]
    assert f"Lower --cpus-per-rank (at most {host_cpus()}" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("nothing was started"), out.stdout
    assert not sessions, f"a Ray session was started before the refusal: {sessions}"


def test_compile_refuses_a_private_cluster_too_small_before_starting_ray_or_writing(tmp_path):
    out_dir = tmp_path / "c"
    out, sessions = _run(["-m", "launcher", "compile", "--out", str(out_dir), "--buckets", "16",
                          "--cpus-per-rank", TOO_MANY_CPUS, "--quiet"])
    assert out.returncode == 2 and f"{WOULD_START} cannot place a TP group" in out.stderr, out.stderr[-3000:]
    assert out.stderr.rstrip().endswith("nothing was written"), out.stderr[-3000:]
    assert not sessions, f"a Ray session was started before the refusal: {sessions}"
    assert list(tmp_path.iterdir()) == []


PLAN_CHECK = textwrap.dedent("""
    import sys, types
    from launcher.api import LaunchConfig
    from launcher.launch_plan import refuse_what_a_private_start_cannot_hold
    for address in ("local", "127.0.0.1:1"):
        config = LaunchConfig(ray_address=address, tp=1, cpus_per_rank=float(sys.argv[1]))
        try:
            refuse_what_a_private_start_cannot_hold(config, types.SimpleNamespace(tp_degree=1), "cpu", "none done")
            print(address, "accepted", flush=True)
        except Exception as err:
            print(address, type(err).__name__, flush=True)
""")


def test_a_cluster_joined_by_address_is_not_judged_by_this_hosts_cpus():
    """Its nodes are not this host: the CPUs asked may be there, and only the connection tells."""
    out, sessions = _run(["-c", PLAN_CHECK, TOO_MANY_CPUS])
    assert out.stdout.split() == ["local", "PlacementImpossible", "127.0.0.1:1", "accepted"], out.stderr[-3000:]
    assert not sessions


def test_fewer_groups_than_replicas_are_named_with_the_count_held():
    # ranks of 2 CPUs on one 4-CPU node: two groups of TP 1 at once, not three
    assert fewer_groups_why({"CPU": 2.0}, 1, 1, [{"CPU": 4.0}], 2, cpus_per_rank_given=True) is None
    assert fewer_groups_why({"CPU": 2.0}, 1, 1, [{"CPU": 4.0}], 3, cpus_per_rank_given=True) == (
        "holds 2 TP group(s) of 1 rank(s) at 2 CPU a rank (--cpus-per-rank), not the 3 replicas asked (--replicas); "
        "lower --replicas to 2 or --cpus-per-rank, or use --replicas auto")


def test_a_group_one_node_can_hold_is_never_placeable_on_none():
    assert never_placeable_why({"CPU": 2.0}, 2, 1, [{"CPU": 4.0}], ["this host"]) is None
    why = never_placeable_why({"CPU": 2.0}, 3, 1, [{"CPU": 4.0}], ["this host"])
    assert why is not None and "this host has {CPU: 4}" in why and "lower --tp" in why, why
