"""Whether a process on this host is still running (stale-file sweeps ask it of their writers)."""

from __future__ import annotations

import hashlib
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


HOST_PART_CHARS = 32
"""The most characters of the host name a writer tag holds (the tag goes into names near the file
system's limit: atomic_dir's `.NAME.v-HOST-PID-RANDOM`)."""
HOST_HASH_CHARS = 8


def host_part(hostname: str) -> str:
    """The host name as a writer tag holds it: letters and digits, anything else `_`; a longer name
    than HOST_PART_CHARS keeps a readable start and a hash of the whole name. Cut to its first 32
    characters, the pods of one Kubernetes workload (raycluster-kuberay-workergroup-worker-8lz2x,
    ...-q7k4m: the differing part at the end) had one tag, and one pod's sweep of shared storage
    deleted another's folder still being written, its pid being gone on the pod sweeping."""
    readable = re.sub(r"[^A-Za-z0-9]", "_", hostname) or "host"
    if len(readable) <= HOST_PART_CHARS:
        return readable  # as the tags of earlier releases: their folders are still told apart
    digest = hashlib.sha1(hostname.encode("utf-8", "surrogateescape")).hexdigest()[:HOST_HASH_CHARS]
    return f"{readable[:HOST_PART_CHARS - HOST_HASH_CHARS - 1]}_{digest}"


def writer_tag() -> str:
    """HOST-PID of this process, for the names of files and folders it is writing, so that a later
    sweep can tell whether their writer may still run (`writer_may_run`). A name written by an
    earlier release on a host whose name is longer than HOST_PART_CHARS holds the name's first 32
    characters, which no host_part gives: such a writer counts as another host's, left to the age
    of what it wrote (its name cannot tell this host's from another pod's of the same prefix)."""
    return f"{host_part(socket.gethostname())}-{os.getpid()}"


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
