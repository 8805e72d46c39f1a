"""Modes for files corelaunch writes to be shared: what the umask allows, as any tool's files get.

safetensors' save_file writes 0600 whatever the umask, so a folder meant for others (the built-in
model's conversion in a shared cache, a compiled-model directory another user starts from or copies)
had weights only its writer could read.
"""

from __future__ import annotations

import contextlib
import os


def process_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc), else by setting
    and restoring it at once."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: os.PathLike | str, umask: int | None = None) -> None:
    """Give the file at `path` the mode a plain write would have given it (0666 less the umask)."""
    os.chmod(path, 0o666 & ~(process_umask() if umask is None else umask))
