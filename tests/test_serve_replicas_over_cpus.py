"""`corelaunch serve` refuses, before Ray starts, more Serve replicas than this host's CPUs hold at
an explicit --cpus-per-rank: the plan checked one group (each replica's Launcher has one), and the
replicas past the CPUs waited for placement until --ready-timeout (900 s by default). Without
--cpus-per-rank each rank's share is sized for that many replicas, so the same count starts.

Each command runs in a fresh process with a Ray temp dir of its own (RAY_TMPDIR): a Ray session in
this test process would make the check one for after the connection (launch_plan's rule)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from launcher.cluster.resources import fewer_groups_why
from shardlib.host_cpus import host_cpus
from workers.net import free_port

REPO = Path(__file__).resolve().parents[1]
# one group of TP 1 fits this host at this share; two never do, whatever the host's CPU count
THREE_QUARTERS_OF_THE_HOST = f"{0.75 * host_cpus():g}"
WOULD_START = "the private Ray cluster this launch would start (this host alone)"


def _serve(*flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`corelaunch serve FLAGS` on a free port; (result, the Ray sessions it left in its temp dir)."""
    with tempfile.TemporaryDirectory(prefix="clray", dir="/tmp") as tmp:  # short: Ray's socket paths
        env = {**os.environ, "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run([sys.executable, "-m", "launcher", "serve", "--port", str(free_port()), "--no-compile",
                              "--quiet", "--ready-timeout", "60", *flags],
                             capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        return out, sorted(p.name for p in Path(tmp).rglob("session_*"))


def test_more_replicas_than_the_cpus_hold_are_refused_before_ray_starts():
    out, sessions = _serve("--replicas", "2", "--cpus-per-rank", THREE_QUARTERS_OF_THE_HOST)
    assert out.returncode == 2, out.stderr[-3000:]
    assert (f"{WOULD_START} holds 1 TP group(s) of 1 rank(s) at {THREE_QUARTERS_OF_THE_HOST} CPU a rank "
            f"(--cpus-per-rank), not the 2 replicas asked (--replicas); lower --replicas to 1 or --cpus-per-rank; "
            f"nothing was started") in out.stderr, out.stderr[-3000:]
    assert "auto" not in out.stderr  # serve's --replicas takes a number only
    assert not sessions, f"a Ray session was started before the refusal: {sessions}"


def test_an_autoscaling_maximum_past_the_cpus_is_named_as_max_replicas():
    out, sessions = _serve("--min-replicas", "1", "--max-replicas", "2", "--cpus-per-rank",
                           THREE_QUARTERS_OF_THE_HOST)
    assert out.returncode == 2, out.stderr[-3000:]
    # "lower --max-replicas to 1", from --min-replicas 1, would be refused in turn (nothing to scale)
    assert ("not the 2 replicas asked (--max-replicas); use --replicas 1 (a fixed count: autoscaling needs "
            "--max-replicas above --min-replicas 1) or --cpus-per-rank") in out.stderr, out.stderr[-3000:]
    assert not sessions, f"a Ray session was started before the refusal: {sessions}"


def test_an_autoscaling_range_the_cpus_still_hold_is_told_to_lower_its_maximum():
    # ranks of 1 CPU on one 3-CPU node: three groups of TP 1, not four; from a minimum of 2, 3 still scales
    assert fewer_groups_why({"CPU": 1.0}, 1, 1, [{"CPU": 3.0}], 4, cpus_per_rank_given=True, option="--max-replicas",
                            auto_offered=False, least=2) == (
        "holds 3 TP group(s) of 1 rank(s) at 1 CPU a rank (--cpus-per-rank), not the 4 replicas asked "
        "(--max-replicas); lower --max-replicas to 3 or --cpus-per-rank")
