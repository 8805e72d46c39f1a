"""Whether a process on this host is still running (stale-file sweeps ask it of their writers)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """pid exists in this pid namespace and has not exited (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1][1:2]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")
