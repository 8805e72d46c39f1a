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
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            limits += _limits_along(root, path, "memory.max")
        elif "memory" in controllers.split(","):  # v1's memory controller
            limits += _limits_along(root / "memory", path, "memory.limit_in_bytes")
    return min(limits, default=None)


def _limits_along(mount: Path, path: str, file_name: str) -> list[int]:
    """The numeric limits in `file_name` from mount/path up to the mount itself."""
    here = mount / path.strip("/")
    found = []
    while True:
        limit = _read_limit(here / file_name)
        if limit is not None:
            found.append(limit)
        if here == mount or mount not in here.parents:
            return found
        here = here.parent


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": none
        return None
    return int(text) if int(text) < NO_LIMIT_FROM else None
