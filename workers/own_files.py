"""Opening a file under a name other local users could have placed (/dev/shm, a shared cache): never
through a symlink, never waiting on a FIFO, and used only as a regular file of this user's that no
other user can read or write."""

from __future__ import annotations

import errno
import os
import stat

OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Every such open: any local user can create names there, and a FIFO opened without O_NONBLOCK
blocks until a writer appears (for ever); a symlink could point anywhere."""


class UntrustedEntry(RuntimeError):
    """A name that is not a regular file of this user's (a FIFO, a symlink, another user's file):
    never read, written, mapped or removed."""


def open_own_entry(path: str, flags: int, what: str = "a shared-memory segment", mode: int = 0o600,
                   private: bool = True) -> int:
    """A descriptor of `path` opened (with `flags`; `mode` where they create it) without blocking or
    following a symlink, once fstat shows a regular file owned by this user that (where `private`)
    no other user can read or write; UntrustedEntry naming the path (and `what` it should have been)
    otherwise, FileNotFoundError when it does not exist."""
    try:
        fd = os.open(path, flags | OPEN_FLAGS, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UntrustedEntry(f"{path} is a symlink, not {what}; refusing to follow it") from None
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file (a FIFO, device or directory someone placed there)"
    elif st.st_uid != os.getuid():
        why = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif private and st.st_mode & 0o077:
        why = f"is open to other users (mode {stat.S_IMODE(st.st_mode):o}; corelaunch creates these 0600)"
    if why:
        os.close(fd)
        raise UntrustedEntry(f"{path} {why}; refusing to use it. If another user placed it there, "
                             f"remove it (or have them remove it)")
    return fd
