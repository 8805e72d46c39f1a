"""shardlib/cgroup_memory.py: the memory limit of this process's cgroup, which the cpu planning
target takes for the host's RAM where it is lower (a container's), over file trees laid out as
/sys/fs/cgroup and /proc/self/cgroup are for each cgroup version."""

from __future__ import annotations

from pathlib import Path

from shardlib.cgroup_memory import cgroup_memory_limit

GIB = 1 << 30
V1_UNLIMITED = "9223372036854771712"  # what v1 reports without a limit (the maximum, page-rounded)


def tree(root: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """(the cgroup mount, the /proc/self/cgroup file) of a layout: files maps paths under the mount
    to their contents."""
    mount = root / "sys_fs_cgroup"
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text + "\n")
    mount.mkdir(parents=True, exist_ok=True)
    own = root / "self_cgroup"
    own.write_text(self_cgroup)
    return mount, own


def test_v2_takes_the_lowest_limit_from_the_own_cgroup_up_to_the_root(tmp_path):
    mount, own = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "memory.max": "max", "kubepods/memory.max": str(64 * GIB), "kubepods/pod1/memory.max": str(8 * GIB),
        "kubepods/pod1/ctr/memory.max": "max"})
    assert cgroup_memory_limit(mount, own) == 8 * GIB


def test_v2_in_a_cgroup_namespace_reads_the_root(tmp_path):
    mount, own = tree(tmp_path, "0::/\n", {"memory.max": str(6 * GIB)})
    assert cgroup_memory_limit(mount, own) == 6 * GIB


def test_v1_reads_the_memory_controllers_hierarchy(tmp_path):
    """As on hosts where the process sits in a v1 memory cgroup of its own (this project's CI)."""
    mount, own = tree(tmp_path, "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/\n", {
        "memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/process_api/memory.limit_in_bytes": str(12 * GIB),
        "memory/process_api/abc/memory.limit_in_bytes": V1_UNLIMITED})
    assert cgroup_memory_limit(mount, own) == 12 * GIB
    mount, own = tree(tmp_path / "none", "4:memory:/process_api/abc\n", {
        "memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/process_api/abc/memory.limit_in_bytes": V1_UNLIMITED})
    assert cgroup_memory_limit(mount, own) is None  # v1's "no limit"


def test_no_limit_or_no_cgroup_gives_none(tmp_path):
    mount, own = tree(tmp_path, "0::/user.slice\n", {"memory.max": "max", "user.slice/memory.max": "max"})
    assert cgroup_memory_limit(mount, own) is None
    mount, own = tree(tmp_path / "nomem", "3:cpu,cpuacct:/\n", {})  # v1 without the memory controller
    assert cgroup_memory_limit(mount, own) is None
    assert cgroup_memory_limit(mount, tmp_path / "absent") is None  # not Linux, or no /proc


def test_the_cpu_target_takes_a_lower_cgroup_limit_for_its_ram(monkeypatch):
    import shardlib.cgroup_memory as cgroup_memory
    from shardlib import instances

    total = instances._mem_total_bytes()
    monkeypatch.setattr(cgroup_memory, "cgroup_memory_limit", lambda: 3 * GIB)
    assert instances._host_ram_bytes() == min(total, 3 * GIB) == 3 * GIB
    monkeypatch.setattr(cgroup_memory, "cgroup_memory_limit", lambda: None)
    assert instances._host_ram_bytes() == total
