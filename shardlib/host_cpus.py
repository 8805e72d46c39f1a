"""The CPUs this process may use: the host's count, lowered by its CPU affinity (taskset, a
cpuset) and by the CPU quota of the cgroup it runs in (a container's `--cpus`, a systemd unit's
CPUQuota). A private cluster declared os.cpu_count() to Ray, overriding Ray's own detection: in a
container limited to 4 CPUs on a 64-core host a rank got 64 threads, and --replicas auto, serve's
sizing and the planner's refusals counted 64.

The quota is read as shardlib/cgroup_memory.py reads the memory limit: v2's single hierarchy
(`0::PATH`, `cpu.max` = "QUOTA PERIOD" or "max PERIOD") and v1's cpu controller (`N:cpu,...:PATH`,
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, a quota of -1 being none), the lowest along the path
from the process's own cgroup up to the mount: a parent's quota holds for its children."""

from __future__ import annotations

import math
import os
from pathlib import Path

from shardlib.cgroup_memory import CGROUP_ROOT, SELF_CGROUP, cgroup_folders


def host_cpus(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs this process may use: the least of the host's count, its affinity and its cgroup's
    quota (a fractional quota rounded up: 2.5 CPUs of time keep 3 threads busy part of it), at least 1."""
    counts = [os.cpu_count() or 1]
    if (affinity := _affinity_count()) is not None:
        counts.append(affinity)
    if (quota := cgroup_cpu_quota(root, self_cgroup)) is not None:
        counts.append(math.ceil(quota))
    return max(1, min(counts))


def _affinity_count() -> int | None:
    """The CPUs this process may be scheduled on (None where the OS does not say: not Linux)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    try:
        return len(getter(0)) or None
    except OSError:
        return None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """The lowest CPU quota, in CPUs, on this process's cgroup path (quota / period), or None where
    there is none (no cgroup, no cpu controller, "max", or v1's -1)."""
    # v1's cpu controller: mounted as cpu, or cpu,cpuacct linked as cpu
    quotas = [quota for folder, v2 in cgroup_folders("cpu", root, self_cgroup)
              if (quota := (_v2_quota if v2 else _v1_quota)(folder)) is not None]
    return min(quotas, default=None)


def _v2_quota(folder: Path) -> float | None:
    """cpu.max's "QUOTA PERIOD" as CPUs; None for "max", a missing file or an unreadable one."""
    fields = _read(folder / "cpu.max").split()
    if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit() or int(fields[1]) == 0:
        return None
    return int(fields[0]) / int(fields[1])


def _v1_quota(folder: Path) -> float | None:
    """cpu.cfs_quota_us / cpu.cfs_period_us as CPUs; None for a quota of -1 (none) or a missing file."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    if not quota.isdigit() or not period.isdigit() or int(period) == 0:  # "-1": no quota
        return None
    return int(quota) / int(period)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
