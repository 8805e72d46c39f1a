"""shardlib/host_cpus.py: the CPUs this process may use (affinity and cgroup quota counted), which a
private Ray cluster declares and the cpu planning target counts. Both took os.cpu_count(): in a
container limited to 4 CPUs on a 64-core host a rank got 64 threads. The quota is read over file
trees laid out as /sys/fs/cgroup and /proc/self/cgroup are for each cgroup version; the affinity
is set for real in a child process (as `taskset` does)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from shardlib.host_cpus import cgroup_cpu_quota, host_cpus
from tests.test_cgroup_memory import tree

REPO = Path(__file__).resolve().parents[1]
ALL_CPUS = os.cpu_count() or 1


def test_v2_takes_the_lowest_quota_from_the_own_cgroup_up_to_the_root(tmp_path):
    mount, own = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "max 100000", "kubepods/cpu.max": "800000 100000", "kubepods/pod1/cpu.max": "250000 100000",
        "kubepods/pod1/ctr/cpu.max": "max 100000"})
    assert cgroup_cpu_quota(mount, own) == 2.5


def test_v1_reads_the_cpu_controllers_hierarchy(tmp_path):
    """As docker --cpus 1.5 on a v1 host; -1 is v1's "no quota"."""
    mount, own = tree(tmp_path, "9:name=systemd:/\n4:memory:/\n3:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "cpu/docker/abc/cpu.cfs_quota_us": "150000", "cpu/docker/abc/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(mount, own) == 1.5
    mount, own = tree(tmp_path / "none", "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(mount, own) is None


def test_no_quota_or_no_cgroup_gives_none(tmp_path):
    mount, own = tree(tmp_path, "0::/user.slice\n", {"cpu.max": "max 100000", "user.slice/cpu.max": "max 100000"})
    assert cgroup_cpu_quota(mount, own) is None
    mount, own = tree(tmp_path / "nocpu", "4:memory:/x\n", {})  # v1 without the cpu controller
    assert cgroup_cpu_quota(mount, own) is None
    assert cgroup_cpu_quota(mount, tmp_path / "absent") is None  # not Linux, or no /proc


def test_host_cpus_is_the_least_of_count_affinity_and_quota_rounded_up(tmp_path):
    usable = len(os.sched_getaffinity(0))
    mount, own = tree(tmp_path, "0::/ctr\n", {"ctr/cpu.max": "50000 100000"})  # half a CPU: one thread
    assert host_cpus(mount, own) == 1
    mount, own = tree(tmp_path / "big", "0::/ctr\n", {"ctr/cpu.max": f"{1000 * 100000} 100000"})
    assert host_cpus(mount, own) == min(ALL_CPUS, usable)  # a quota above the host binds nothing
    mount, own = tree(tmp_path / "frac", "0::/ctr\n", {"ctr/cpu.max": "150000 100000"})
    assert host_cpus(mount, own) == min(2, ALL_CPUS, usable)


COUNTS_ON_ONE_CPU = textwrap.dedent("""
    import os
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # as `taskset -c N` does
    from launcher.cluster.ray_cluster import private_cluster_cpus
    from shardlib.instances import get_instance
    print(private_cluster_cpus(), get_instance("cpu").physical_cores, private_cluster_cpus(3), flush=True)
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin a process to one of them")
def test_a_process_pinned_to_one_cpu_plans_and_declares_one():
    """Pinned with taskset, the private cluster declared (and the planner counted) every CPU of the host."""
    out = subprocess.run([sys.executable, "-c", COUNTS_ON_ONE_CPU], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "1", "3"]  # --cpus-per-rank's count, given outright, still wins


PRIVATE_RAY_ON_ONE_CPU = textwrap.dedent("""
    import os
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import ray
    from launcher.cluster import ray_cluster
    connection = ray_cluster.connect("local")
    print(ray.cluster_resources().get("CPU"), flush=True)
    connection.close()
""")


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin a process to one of them")
def test_a_private_ray_started_on_one_cpu_declares_one():
    """connect() passed os.cpu_count() to ray.init(num_cpus=...), overriding Ray's own count."""
    with tempfile.TemporaryDirectory(prefix="hcray", dir="/tmp") as tmp:  # short: Ray's socket paths live under it
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        env.pop("RAY_ADDRESS", None)
        child = subprocess.Popen([sys.executable, "-c", PRIVATE_RAY_ON_ONE_CPU], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
        try:
            out, err = child.communicate(timeout=180)
        finally:
            _kill_group(child)
    assert child.returncode == 0, err[-3000:]
    assert out.split() == ["1.0"]


def _kill_group(child: subprocess.Popen) -> None:
    """Whatever of Ray's a failed run left in the session this test started."""
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()
