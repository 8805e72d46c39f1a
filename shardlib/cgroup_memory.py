"""The memory limit of the cgroup this process runs in (a container's, a systemd unit's, a Ray
worker's), which the planner takes for this host's RAM where it is lower than MemTotal: a container
limited to 8 GiB on a 64 GiB host was planned as if it had 64 GiB, and a layout that did not fit
was started and killed by the out-of-memory killer.

Both cgroup versions are read from /proc/self/cgroup: v2's single hierarchy (`0::PATH`, limit in
`memory.max`) and v1's memory controller (`N:memory:PATH`, limit in `memory.limit_in_bytes`). The
limit that binds is the lowest along the path, from the process's own cgroup up to the root: a
parent's limit holds for its children, and inside a container's cgroup namespace the container's
cgroup is the root itself."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


NO_LIMIT_FROM = 1 << 62
"""v1 reports "no limit" as the largest page-rounded value (9223372036854771712): a limit this
large or above is none."""


def cgroup_memory_limit(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """The lowest memory limit in bytes on this process's cgroup path, or None where there is none
    (no cgroup, no memory controller, "max", or a v1 limit left at its page-rounded maximum)."""
    limits = [limit for folder, v2 in cgroup_folders("memory", root, self_cgroup)
              if (limit := _read_limit(folder / ("memory.max" if v2 else "memory.limit_in_bytes"))) is not None]
    return min(limits, default=None)


def cgroup_folders(controller: str, root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP
                   ) -> list[tuple[Path, bool]]:
    """(folder, is v2) for each folder of this process's cgroup path that holds `controller`'s
    settings, from its own cgroup up to the mount (a parent's setting holds for its children): v2's
    single hierarchy (`0::PATH`) and v1's hierarchy of that controller (`N:cpu,cpuacct:PATH`, mounted
    as ROOT/controller); [] where the process's cgroup file cannot be read."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            folders += [(folder, True) for folder in _up_to_the_mount(root, path)]
        elif controller in controllers.split(","):
            folders += [(folder, False) for folder in _up_to_the_mount(root / controller, path)]
    return folders


def _up_to_the_mount(mount: Path, path: str) -> list[Path]:
    """mount/path and each folder above it, up to the mount itself."""
    here = mount / path.strip("/")
    found = [here]
    while here != mount and mount in here.parents:
        here = here.parent
        found.append(here)
    return found


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": none
        return None
    return int(text) if int(text) < NO_LIMIT_FROM else None
