"""Whether a process on this host is still running (stale-file sweeps ask it of their writers)."""

from __future__ import annotations

import os
import re
import socket


def process_alive(pid: int) -> bool:
    """pid exists in this pid namespace and has not exited (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)
    return not fields or fields[0] not in (b"Z", b"X")


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after "PID (comm)" (the name may hold spaces and parentheses):
    [state, ppid, ...]; None where it cannot be read (gone, not ours, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def writer_tag() -> str:
    """HOST-PID of this process, for the names of files and folders it is writing, so that a later
    sweep can tell whether their writer may still run (`writer_may_run`)."""
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:32] or "host"
    return f"{host}-{os.getpid()}"


def writer_may_run(tagged: str) -> bool:
    """Whether the writer named in "HOST-PID-RANDOM" (writer_tag() and a random part) may still run:
    True unless it is on this host and its pid is gone; False for a name not written so."""
    parts = tagged.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return False  # not a name written with writer_tag(): nobody owns it
    host, pid = parts[0], int(parts[1])
    if host != writer_tag().rsplit("-", 1)[0]:
        return True  # another host: only the age tells
    return process_alive(pid)
