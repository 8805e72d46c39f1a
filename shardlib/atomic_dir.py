"""Writing a directory so that its path always names a complete one. Used for pre-sharded
checkpoints and compiled-model directories.

Layout: the output path is a symlink to a hidden versioned sibling,
  out -> .out.v-HOST-PID-RANDOM/
A write fills a new versioned sibling, fsyncs its files and folders, then swaps the symlink with
one rename(2) of a new symlink over the old one, so at every instant `out` names the old complete
directory or the new complete one. The previous version is removed after the swap, best effort:
the write is committed by then, so an error or an interrupt there never removes the new version
(an interrupt still reaches the caller), and what is left of the previous one is swept by the next
write, this process's own included.

A writer killed part way leaves a versioned sibling nobody links to; the next write to the same
path sweeps those whose writer is gone (same host and its pid is dead) or that are older than
STALE_AFTER_S. Folders left by the earlier scheme (.out.tmp-*, .out.old-*) are swept when older
than LEGACY_STALE_AFTER_S. `corelaunch quantize`, which renames a finished folder into place
itself, writes it as .out.partial-HOST-PID-RANDOM, swept by the same rule.

An `out` written by the earlier scheme (a plain directory) is exchanged for the symlink with
renameat2(RENAME_EXCHANGE) where the filesystem offers it; elsewhere it is renamed aside and the
symlink put in its place, the one moment at which `out` is absent.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from shardlib.process_alive import writer_may_run, writer_tag

from shardlib.manifest import MANIFEST

_OWNED = re.compile(r"[A-Za-z0-9_]{1,32}-[0-9]+-[0-9a-f]{8}")
"""HOST-PID-RANDOM, as writer_tag() and secrets.token_hex(4) write it after `.NAME.v-` / `.NAME.lnk-`."""
_LEGACY = re.compile(r"[a-z0-9_]{8}")
"""tempfile.mkdtemp's random part, after the earlier scheme's `.NAME.tmp-` / `.NAME.old-`."""
STALE_AFTER_S = 24 * 3600.0
"""An unlinked version whose writer cannot be checked (another host) is swept after this long."""
LEGACY_STALE_AFTER_S = 3600.0
"""Leftovers of the earlier scheme carry no pid: swept after this long."""


def refuse_foreign_dir(out_dir: str | Path, what: str, marker: str = MANIFEST,
                       read_kind: Callable[[Path], Any] | None = None) -> None:
    """FileExistsError when out_dir is a file, or holds files but is not a directory of the kind
    being written (`what`, e.g. "a pre-sharded checkpoint"), so replacing it would delete someone's
    data: it has no `marker`, or `read_kind` (that kind's manifest reader, raising ValueError or
    OSError for anything else) refuses it. A marker alone is a file any project may have (a web
    app's manifest.json was replaced whole), and the other kind of corelaunch directory has one too."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink() and current_version(out_dir) is None:
        # the writer replaces out_dir by a link to a version it writes beside it: a user's own link
        # (to a larger disk, say) was replaced, its target left as it was and the files put here
        raise FileExistsError(f"{out_dir} is a link to {os.readlink(out_dir)} that no writer of {what} made: writing "
                              f"would replace the link and put the files beside it in {out_dir.parent}; pass a new "
                              f"folder inside the directory it points to ({out_dir.resolve() / out_dir.name}), or "
                              f"remove the link")
    if out_dir.exists() and not out_dir.is_dir():  # a file (or a link to one): iterdir would raise
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose a new or empty directory, or "
                              f"remove the file")
    if out_dir.is_dir() and not out_dir.is_symlink() and in_use(out_dir):
        # a plain directory (a `cp -rL` copy) a launch reads by its path: replaced, the launch's
        # restarts would read the new files; deleted, they fail (a link's versions stay while held)
        raise FileExistsError(f"{out_dir} is in use by a running launch, and is a plain directory "
                              f"that cannot be replaced under it; write to another path, or stop that launch first")
    if not (out_dir.exists() and any(out_dir.iterdir())):
        return
    if not (out_dir / marker).is_file():
        raise FileExistsError(f"{out_dir} exists and is not {what} (it has no {marker}); choose a new or empty "
                              f"directory, or remove it")
    if read_kind is not None:
        try:
            read_kind(out_dir)
        except (ValueError, OSError) as err:
            raise FileExistsError(f"{out_dir} exists and is not {what} (its {marker} is not one: "
                                  f"{str(err).split('; ')[0]}); choose a new or empty directory, or remove it") from None


def unwritable_reason(path: str | Path) -> str | None:
    """Why this process cannot create `path` (a directory written by atomic_dir, or a file), from a
    cheap look that writes nothing; None when nothing is seen against it. Its missing parents are
    created by the writer, so the nearest ancestor that exists must be a directory this process may
    create entries in. Callers refuse with it before expensive work and still catch OSError around
    the write: permissions can say yes where the filesystem says no (/proc, /sys, read-only mounts)."""
    parent = Path(path).parent  # as given (relative stays relative): the message quotes it
    try:
        while not parent.exists() and parent != parent.parent:  # exists() is False below a file, too
            parent = parent.parent
    except OSError as err:  # a folder on the way that this user may not search
        return f"{parent} cannot be reached ({err.strerror})"
    if not parent.is_dir():
        return f"{parent} is {'a file, ' if parent.is_file() else ''}not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable by this user"
    return None


def sibling_name_too_long(out_dir: str | Path, kind: str) -> str | None:
    """Why out_dir's name is too long for the hidden sibling `.NAME.KIND-HOST-PID-RANDOM` written
    beside it until it is complete (atomic_dir's "v" and "lnk", quantize's "partial"), or None: a
    name a little under the file system's limit passed every check and failed at that sibling's
    creation, with "[Errno 36] File name too long" naming the sibling, which the user never chose."""
    out_dir = Path(out_dir)
    name, sibling = len(os.fsencode(out_dir.name)), len(os.fsencode(f"{_prefix(out_dir, kind)}{writer_tag()}-")) + 8
    limit = _name_limit(out_dir.parent)
    if sibling <= limit:
        return None
    return (f"its name is {name} bytes long, and the folder written beside it until it is complete "
            f"(.NAME.{kind}-{writer_tag()}-RANDOM) would pass the file system's limit of {limit} bytes a name; "
            f"use a name of at most {max(limit - (sibling - name), 0)} bytes")


def _name_limit(folder: Path) -> int:
    """The longest name (bytes) the file system holding `folder` (or its nearest existing ancestor) takes."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255  # every Linux file system's


def names_out_dir(out_dir: str | Path, path: str | Path | None) -> bool:
    """Whether `path` (an OSError's filename) is out_dir, inside it, or one of the siblings
    atomic_dir writes beside it (.NAME.v-*, .NAME.lnk-*): a failed write of out_dir, as against a
    failed read of some input."""
    if not isinstance(path, (str, bytes, os.PathLike)):  # None, or a file descriptor
        return False
    out, failed = Path(out_dir).absolute(), Path(os.fsdecode(path)).absolute()
    return any(p == out or (p.parent == out.parent and p.name.startswith(f".{out.name}."))
               for p in (failed, *failed.parents))


class ParentNotCreated(OSError):
    """A missing parent folder of `out_dir` (the error's filename) that make_parents could not
    create: a failed write of out_dir, though the path it names is not out_dir nor inside it."""

    out_dir: Path


def make_parents(out_dir: str | Path) -> None:
    """Create out_dir's missing parent folders; ParentNotCreated when the filesystem refuses one
    (/proc, /sys, read-only mounts, which the up-front look of unwritable_reason lets through)."""
    try:
        Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        failure = ParentNotCreated(err.errno, err.strerror, err.filename)
        failure.out_dir = Path(out_dir)
        raise failure from err


WRITE_ONLY_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
"""Failures only a write gives (a full disk, a file size limit, a quota): an error of these without a
file name (a write to an open file carries none) is the output's, never an input's read."""


def write_refusal_fix(number: int | None) -> str:
    """The way out of a write refused with WRITE_ONLY_ERRNOS' `number`, for the end of a "could not
    write --out OUT (...)" refusal: another path in a directory one can write to does not help a
    full disk on the same one; any other number (or None: a folder one cannot write) is that."""
    if number == errno.EFBIG:  # the process's file size limit, whatever the disk
        return "raise the file size limit (`ulimit -f`), or pass a path on another disk"
    if number == errno.EDQUOT:
        return "free space within your disk quota, or pass a path on another disk"
    if number == errno.ENOSPC:
        return "free space, or pass a path on another disk"
    return "pass a new path in a directory you can write to"


def out_dir_failure(out_dir: str | Path, err: OSError) -> str | None:
    """What an OSError says when it is a failed write of out_dir (names_out_dir of its filename, or
    a parent make_parents could not create, or a write-only failure of no file: WRITE_ONLY_ERRNOS),
    for a "could not write --out OUT (...)" refusal; None when it is some other failure (a read of
    an input)."""
    if isinstance(err, ParentNotCreated) and err.out_dir.absolute() == Path(out_dir).absolute():
        return f"its parent folder {err.filename} could not be created: {err.strerror}"
    if err.filename is None and err.errno in WRITE_ONLY_ERRNOS:  # a full disk said only "[Errno 28] ..."
        return str(err)
    return str(err) if names_out_dir(out_dir, err.filename) else None


_UNFINISHED: dict[Path, Path] = {}
"""Version directories this process is writing (atomic_dir), each with its out_dir, for
remove_unfinished()."""


def remove_unfinished() -> None:
    """Remove the version directories this process is still writing: for a process about to exit
    without unwinding (launcher/termination.py, when SIGTERM reached its private Ray too), whose
    writers' own clean-up will never run. A later write to the same out_dir would sweep them, but
    only once it came."""
    for version, out_dir in list(_UNFINISHED.items()):
        linked = current_version(out_dir)
        if linked is None or linked.absolute() != version.absolute():  # not switched in (the signal came mid-swap)
            shutil.rmtree(version, ignore_errors=True)


@contextmanager
def atomic_dir(out_dir: str | Path, what: str, marker: str = MANIFEST,
               read_kind: Callable[[Path], Any] | None = None) -> Iterator[Path]:
    """Yield an empty new version directory to write into. When the block ends normally, its
    files are fsynced and `out_dir` is switched to it atomically; when it raises, it is removed and
    out_dir is left as it was.

    A non-empty out_dir that is not of this kind is refused first (refuse_foreign_dir). Stale
    versions left by killed writers are swept before writing.
    """
    out_dir = Path(out_dir)
    refuse_foreign_dir(out_dir, what, marker, read_kind)
    make_parents(out_dir)
    sweep_stale(out_dir)
    version = out_dir.parent / f"{_prefix(out_dir, 'v')}{writer_tag()}-{secrets.token_hex(4)}"
    # registered before it exists: another thread's sweep of the same out_dir (_own_abandoned) takes
    # a version of this process that is not being written for one whose removal was cut short
    _UNFINISHED[version] = out_dir
    try:
        version.mkdir()
        yield version
        version.chmod(0o755)
        fsync_tree(version)
        _swap(out_dir, version)
    except BaseException:
        # never the version out_dir already links to: an interrupt (Ctrl-C, SIGTERM) or an error
        # after the switch deleted the committed write, leaving out_dir dangling
        if current_version(out_dir) != version:
            shutil.rmtree(version, ignore_errors=True)
        raise
    finally:
        _UNFINISHED.pop(version, None)


def current_version(out_dir: str | Path) -> Path | None:
    """The versioned sibling out_dir links to, or None (absent, a plain directory, a foreign link)."""
    out_dir = Path(out_dir)
    if not out_dir.is_symlink():
        return None
    target = Path(os.readlink(out_dir))
    if target.parent != Path(".") or not target.name.startswith(_prefix(out_dir, "v")):
        return None
    return out_dir.parent / target.name


def linking_out_dir(version: str | Path) -> Path | None:
    """The out_dir that links to `version` now (a `.NAME.v-HOST-PID-RANDOM` sibling this module
    wrote), or None: messages about a version a launch pinned name the path the user gave."""
    parts = _version_parts(Path(version))
    return parts[0] if parts is not None and current_version(parts[0]) == Path(version) else None


def is_version(path: str | Path) -> bool:
    """Whether `path` is a `.NAME.v-HOST-PID-RANDOM` version folder this module writes (one a launch
    was handed already pinned: a Serve replica given its server's pin)."""
    path = Path(path)
    return _version_parts(path) is not None and path.is_dir() and not path.is_symlink()


def _version_parts(version: Path) -> tuple[Path, str] | None:
    """(out_dir, "HOST-PID-RANDOM") of a `.NAME.v-HOST-PID-RANDOM` sibling this module writes, else None."""
    name, sep, rest = version.name[1:].rpartition(".v-")
    if not version.name.startswith(".") or not sep or not _OWNED.fullmatch(rest):
        return None
    return version.parent / name, rest


def abandoned_version(version: str | Path) -> bool:
    """Whether `version` is a `.NAME.v-HOST-PID-RANDOM` sibling this module wrote that nothing links
    to and whose writer is gone from this host: a write that never finished (killed midway)."""
    parts = _version_parts(Path(version))
    return parts is not None and current_version(parts[0]) != Path(version) and not writer_may_run(parts[1])


def sweep_stale(out_dir: str | Path, now: float | None = None) -> list[Path]:
    """Remove the versions of out_dir that nothing links to and whose writer is gone (or that are
    older than STALE_AFTER_S), and old leftovers of the earlier scheme; returns what was removed."""
    out_dir = Path(out_dir)
    now = time.time() if now is None else now
    keep = current_version(out_dir)
    removed = []
    for entry in out_dir.parent.iterdir() if out_dir.parent.is_dir() else ():
        if entry == keep or not entry.name.startswith(f".{out_dir.name}."):
            continue
        kind, _, rest = entry.name[len(out_dir.name) + 2:].partition("-")
        try:
            age = now - entry.lstat().st_mtime
        except FileNotFoundError:
            continue
        if kind in ("v", "lnk", "partial") and _OWNED.fullmatch(rest):
            stale = age > STALE_AFTER_S or not writer_may_run(rest) or _own_abandoned(kind, entry, rest)
        elif (kind in ("tmp", "old") and _LEGACY.fullmatch(rest)) or (kind == "partial" and rest.isdigit()):
            # (quantize's earlier `.NAME.partial-PID`, which names no host)
            stale = age > LEGACY_STALE_AFTER_S
        else:  # a name this module never writes (someone's .NAME.v-important): not ours to remove
            continue
        if stale and not (kind == "v" and in_use(entry)):
            remove_path(entry)
            removed.append(entry)
    return removed


def _own_abandoned(kind: str, entry: Path, tagged: str) -> bool:
    """Whether `entry` is a version this process wrote and no longer writes (not in _UNFINISHED) that
    nothing links to: the previous version a swap left when its removal was interrupted or failed,
    which waiting for this process to exit would keep for as long as a server runs."""
    return (kind == "v" and tagged.rsplit("-", 1)[0] == writer_tag()
            # a copy: another thread's atomic_dir adds and removes its versions meanwhile
            and entry.absolute() not in {unfinished.absolute() for unfinished in list(_UNFINISHED)})


# ---- versions in use -------------------------------------------------------------------------
# A launch from a compiled directory keeps to the version its link named at start (its model files,
# weights and compile cache). A compile into the same --out deleted that version right after the
# swap: the running server's next graph was built from nothing into a folder inductor made again,
# and its next restart failed for good on the missing files. A launch now holds a shared flock on
# the version's directory while it runs; the swap and the sweep leave a version so held.
def hold_version(version: str | Path) -> int | None:
    """A file descriptor holding a shared lock on `version` (a directory) until closed (os.close);
    None where the directory cannot be opened or locked (the launch goes on unprotected)."""
    return _locked(version, fcntl.LOCK_SH)


def in_use(version: str | Path) -> bool:
    """Whether a launch holds `version` (hold_version), on this host."""
    try:
        fd = os.open(version, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the lock taken just now
    return False


def _locked(directory: str | Path, kind: int) -> int | None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def owned_sibling(out_dir: str | Path, kind: str) -> Path:
    """A new hidden sibling `.NAME.KIND-HOST-PID-RANDOM` of out_dir for a writer that renames it into
    place itself (`corelaunch quantize`'s "partial"): sweep_stale removes it once its writer is gone."""
    out_dir = Path(out_dir)
    return out_dir.parent / f"{_prefix(out_dir, kind)}{writer_tag()}-{secrets.token_hex(4)}"


# ---- the swap --------------------------------------------------------------------------------
def _swap(out_dir: Path, version: Path) -> None:
    previous = current_version(out_dir)
    link = out_dir.parent / f"{_prefix(out_dir, 'lnk')}{writer_tag()}-{secrets.token_hex(4)}"
    os.symlink(version.name, link)  # relative: the pair can be moved or copied together
    try:
        if out_dir.is_dir() and not out_dir.is_symlink():
            _replace_plain_dir(out_dir, link)
        else:
            os.replace(link, out_dir)  # one rename(2): out_dir names the old version or the new one
    except BaseException:
        remove_path(link)
        raise
    fsync_dir(out_dir.parent)  # an error here is raised (the switch may not be on disk); version stays
    _remove_previous(previous, version)


def _remove_previous(previous: Path | None, version: Path) -> None:
    """Remove the version out_dir linked to before the swap, best effort: the write is committed, so
    an OSError here is dropped (the next write's sweep_stale removes what is left), and an interrupt
    (KeyboardInterrupt, SystemExit) reaches the caller with the new version kept."""
    if previous is None or previous == version or in_use(previous):  # a held one: a later sweep's
        return
    shutil.rmtree(previous, ignore_errors=True)  # errors ignored: what is left, the next write sweeps


def _replace_plain_dir(out_dir: Path, link: Path) -> None:
    """Put `link` at out_dir, a plain directory (empty, or written by the earlier scheme)."""
    if not any(out_dir.iterdir()):
        out_dir.rmdir()  # nothing complete was there to keep visible
        os.replace(link, out_dir)
        return
    if _exchange(link, out_dir):
        shutil.rmtree(link, ignore_errors=True)  # the old plain directory, now at link's name
        return
    aside = out_dir.parent / f"{_prefix(out_dir, 'v')}{writer_tag()}-{secrets.token_hex(4)}"
    os.replace(out_dir, aside)
    os.replace(link, out_dir)
    shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


_RENAME_NOREPLACE = 1


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange paths a and b (Linux renameat2); False where it is not offered."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_no_replace(a: Path, b: Path) -> bool:
    """Rename a to b unless b exists (FileExistsError then, atomically: rename(2) replaced an empty
    directory at b); False where the file system does not offer it (the caller renames as it can)."""
    return _renameat2(a, b, _RENAME_NOREPLACE)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(b))
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


# ---- helpers ---------------------------------------------------------------------------------
def _prefix(out_dir: Path, kind: str) -> str:
    return f".{out_dir.name}.{kind}-"


def remove_path(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root (symlinks are not followed), then root itself."""
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems cannot fsync a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)
