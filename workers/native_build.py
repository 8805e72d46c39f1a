"""Small native libraries compiled once on the host and loaded with ctypes, safely.

The shared-memory collectives' synchronisation (workers/shm/native.py) and the small-batch linear
kernel (workers/kernels/small_linear.py) are C sources compiled with the system C compiler, and
the packed-panel kernel with its torch operator (workers/kernels/packed_linear.py) a C++ source
compiled against the installed torch (a C++ compiler, its headers, and libtorch linked with an
rpath into torch's own lib directory). Each is built at first use into this user's own directory
of the corelaunch cache ($CORELAUNCH_CACHE/native-uid<uid>, mode 0700), one file per version of
the source and flags, and loaded with ctypes (which releases the GIL during a call; loading the
C++ one also registers its operator with torch's dispatcher). The cache may be shared, so nothing is loaded from a directory or file
another user owns or could write to (see `build`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import secrets
import shlex
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from shardlib.process_alive import writer_may_run, writer_tag


@dataclass(frozen=True)
class LibrarySpec:
    """A C library to build: its source, compiler flags, file stem and what it is (for messages)."""

    stem: str
    source: str
    flags: tuple[str, ...]
    what: str
    identity: str = ""
    """Anything else the binary depends on (the host's CPU for -march=native), part of its name."""
    language: str = "c"
    """"c", or "c++" (built by $CXX, c++ or g++: a torch operator linked against libtorch)."""

    @property
    def name(self) -> str:
        digest = hashlib.sha256("\0".join((self.source, *self.flags, self.identity, self.language)).encode()
                                ).hexdigest()[:16]
        return f"{self.stem}_{digest}.so"


class NativeUnavailable(RuntimeError):
    """A C library could not be built or loaded (no compiler, read-only cache, untrusted cache, ...)."""


class OutOfDescriptors(NativeUnavailable):
    """The open-files limit was reached: nothing is wrong with the folder or the file."""


class NoExecCache(NativeUnavailable):
    """The folder is on a filesystem mounted noexec: no library in it can be loaded, damaged or not."""


_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def library_dir() -> Path:
    """This user's own directory for compiled libraries: $CORELAUNCH_CACHE/native-uid<uid>.

    The cache may be shared by several users (CORELAUNCH_CACHE on a shared disk), so the library is
    never taken from a directory another user could write to; see `trusted_dir`. Straight under the
    cache, not in a `native/` of its own: the first user to create one (mode 0755) locked every
    other user out of it.

    NativeUnavailable where no cache can be named: CORELAUNCH_CACHE and HOME unset and this uid
    without a passwd entry (a container run as an arbitrary uid), where Path.home() raises
    RuntimeError, which the kernels' loaders, catching NativeUnavailable alone, would pass on: the
    model load then failed instead of falling back to torch's paths."""
    from shardlib.demo_model import default_cache_dir

    try:
        cache = default_cache_dir()
    except RuntimeError as err:
        raise NativeUnavailable(f"no cache directory for the native kernels: CORELAUNCH_CACHE is unset and the "
                                f"home directory is unknown ({err}); set CORELAUNCH_CACHE to a directory this "
                                f"user can write") from None
    return cache / f"native-uid{os.getuid()}"


def untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory (its fstat) must not be trusted, or None."""
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & _UNSAFE_BITS:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted_dir(directory: Path, holding: str = "corelaunch's compiled C libraries") -> int:
    """An open descriptor of `directory`, created with mode 0700 if missing, once checked to be a
    real directory (not a symlink) owned by this user and writable by nobody else.

    Raises NativeUnavailable naming the directory, what it holds (`holding`) and the fix otherwise:
    a library placed there by another user would run inside every rank that loaded it."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise _out_of_descriptors(directory.parent, err) or NativeUnavailable(
            f"could not create {directory.parent}: {err}{_unwritable_hint(err)}") from None
    try:
        try:
            os.mkdir(directory.name, 0o700, dir_fd=parent)
            created = True
        except FileExistsError:
            created = False
        except OSError as err:  # nothing there to distrust: it could not be made (a read-only cache)
            raise _out_of_descriptors(directory, err) or NativeUnavailable(
                f"could not create {directory} for {holding}: {err}; point CORELAUNCH_CACHE at a directory this "
                f"user can write") from None
        fd = os.open(directory.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError as err:
        if (out_of := _out_of_descriptors(directory, err)) is not None:  # nothing says the folder is unsafe
            raise out_of from None
        why = str(err)
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY on a symlink
            try:
                if stat.S_ISLNK(os.stat(directory.name, dir_fd=parent, follow_symlinks=False).st_mode):
                    why = "it is a symlink"
            except OSError:
                pass
        raise NativeUnavailable(_refusal(directory, why, holding)) from None
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if created and st.st_uid == os.getuid():
        os.fchmod(fd, 0o700)  # whatever the umask
        st = os.fstat(fd)
    why = untrusted(st)
    if why:
        os.close(fd)
        raise NativeUnavailable(_refusal(directory, why, holding))
    return fd


def _out_of_descriptors(path: Path, err: OSError) -> OutOfDescriptors | None:
    """The error for an OSError that only says this process (EMFILE) or the host (ENFILE) has no
    descriptor left, else None: under a low `ulimit -n` a cache folder was refused as one another
    user could have planted code in, to be removed."""
    if err.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    return OutOfDescriptors(f"could not open {path}: {err}: the open-files limit (`ulimit -n`) was reached; raise it")


_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
"""What a cache on a read-only mount, or one this user may not write, answers."""


def _unwritable_hint(err: OSError) -> str:
    """The fix to add to a message about `err` when it says the cache cannot be written, else ""."""
    return "; point CORELAUNCH_CACHE at a directory this user can write" if err.errno in _UNWRITABLE else ""


def _refusal(directory: Path, why: str, holding: str) -> str:
    return (f"refusing to use {directory} for {holding}: {why}. Another "
            f"user could place code there that every rank would run. Remove {directory} (it "
            f"is rebuilt, mode 0700, on next use) or point CORELAUNCH_CACHE at a directory only "
            f"you can write to")


def _open_trusted(dir_fd: int, name: str) -> int | None:
    """A descriptor of the library `name` in the trusted directory, or None if it is missing or must
    not be loaded (not a regular file, a symlink, another owner, writable by others): rebuild it."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None  # missing, or a symlink (ELOOP), ...
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or untrusted(st):
        os.close(fd)
        return None
    return fd


_COMPILERS = {"c": ("CC", ("cc", "gcc"), "c", 120), "c++": ("CXX", ("c++", "g++"), "cpp", 600)}
"""language -> (environment variable, compilers to look for, source suffix, seconds a build may take:
a C++ source includes torch's headers)."""


_BUILD_PREFIX = ".build-"
"""A build's own folder inside the trusted directory: .build-HOST-PID-NSnRANDOM (writer_tag, then
the writer's pid namespace, _pid_namespace, and a random part)."""

_UNSEEN_WRITER_S = max(timeout_s for *_, timeout_s in _COMPILERS.values()) + 300.0
"""A build folder of this host whose writer's pid is not alive, written from another pid namespace
(or by a version that did not say which), is swept only once older than this: another container
with the same hostname but its own pid namespace may be compiling there, its pid invisible here.
The folder changes while the compiler runs (its output appears in it) and no build runs longer than
its compiler's timeout, so a folder this old has no live writer."""


def _pid_namespace() -> str:
    """This process's pid namespace, as digits (the inode of /proc/self/ns/pid), or "" where it
    cannot be told: a pid seen from here names the same process only within the same namespace."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _written_in_this_pid_namespace(tag: str) -> bool:
    """Whether the build folder tagged HOST-PID-NSnRANDOM was written in this pid namespace."""
    namespace, marked, _ = tag.rsplit("-", 1)[-1].partition("n")
    here = _pid_namespace()
    return bool(marked) and bool(here) and namespace == here


def _compile(dir_fd: int, directory: Path, spec: "LibrarySpec") -> None:
    """Compile `spec` and move the library into the trusted directory as spec.name, atomically.

    The compiler writes into a folder of this build's own inside the trusted directory, and the
    bytes are then written to a fresh file in that folder (O_EXCL, mode 0700, fsynced) and renamed
    over `name`, so concurrent ranks and launches never load a half-written library and the last rename wins
    with identical contents. The folder is in the cache, not in $TMPDIR, and named after its
    writer: a rank killed while it compiles (SIGKILL, or Ray's SIGTERM handler, which ends the
    process without unwinding the compute thread) leaves it behind, and the next build or load of
    a library in that directory on this host removes it (`_sweep_dead_builds`)."""
    variable, names, suffix, timeout_s = _COMPILERS[spec.language]
    compiler = _compiler_command(variable, names)
    if not compiler:
        raise NativeUnavailable(f"no {spec.language.upper()} compiler found ({', '.join(names)} or ${variable}); "
                                f"it builds {spec.what} once")
    build_name = f"{_BUILD_PREFIX}{writer_tag()}-{_pid_namespace()}n{secrets.token_hex(4)}"
    try:
        os.mkdir(build_name, 0o700, dir_fd=dir_fd)
        try:
            tmp = directory / build_name
            src = tmp / f"source.{suffix}"
            src.write_text(spec.source)
            out = tmp / spec.name
            # The flags after the source: libraries named there (-l) link only when they follow it.
            try:
                proc = subprocess.run([*compiler, "-shared", "-fPIC", "-o", str(out), str(src), *spec.flags],
                                      capture_output=True, text=True, timeout=timeout_s)
            except OSError as err:  # not there, or not executable: about the compiler, not the cache
                raise NativeUnavailable(f"could not build {spec.what}: could not run the compiler "
                                        f"{compiler[0]!r} (from {_compiler_source(variable)}): {err}") from None
            if proc.returncode != 0:
                raise NativeUnavailable(f"{shlex.join(compiler)} failed to build {spec.what}:\n{proc.stderr.strip()}")
            data = out.read_bytes()
            checked = f"{build_name}/checked.so"
            fd = os.open(checked, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o700, dir_fd=dir_fd)
            try:
                os.fchmod(fd, 0o700)  # whatever the umask (a group-writable library would be refused)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # on disk before the rename: a crash must not leave a short library in place
            finally:
                os.close(fd)
            os.replace(checked, spec.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            shutil.rmtree(build_name, dir_fd=dir_fd, ignore_errors=True)
    except OSError as err:
        raise NativeUnavailable(f"could not build {spec.what} in {directory}: {err}{_unwritable_hint(err)}") from None
    except subprocess.SubprocessError as err:
        raise NativeUnavailable(f"could not build {spec.what} in {directory}: {err}") from None


def _compiler_command(variable: str, names: tuple[str, ...]) -> list[str] | None:
    """The compiler's command line: $variable split as a shell (and make) would, so that
    CXX="ccache g++" or CC="gcc -m64" work, else the first of `names` on PATH, else None. A blank
    $variable counts as unset, as the empty one always did."""
    value = os.environ.get(variable, "")
    if value.strip():
        try:
            return shlex.split(value)
        except ValueError as err:  # an unclosed quote
            raise NativeUnavailable(f"${variable}={value!r} is not a command line: {err}") from None
    found = next(filter(None, map(shutil.which, names)), None)
    return [found] if found else None


def _compiler_source(variable: str) -> str:
    """Where the compiler's name came from, for a message: $variable (its value) or PATH."""
    value = os.environ.get(variable, "")
    return f"${variable}={value!r}" if value.strip() else "PATH"


def _sweep_dead_builds(dir_fd: int) -> None:
    """Remove the build folders of writers that are gone (killed while compiling): on this host once
    their pid is, if written in this pid namespace, else once also older than _UNSEEN_WRITER_S (a
    container sharing the hostname but not the pids); elsewhere (a shared cache) once older than
    atomic_dir's STALE_AFTER_S, far past any build's compiler timeout."""
    import time

    from shardlib.atomic_dir import STALE_AFTER_S

    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        if not name.startswith(_BUILD_PREFIX):
            continue
        try:
            age = time.time() - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
        except OSError:
            continue
        tag = name[len(_BUILD_PREFIX):]
        writer_gone = not writer_may_run(tag) and (_written_in_this_pid_namespace(tag) or age > _UNSEEN_WRITER_S)
        if age > STALE_AFTER_S or writer_gone:
            shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)


def build(spec: "LibrarySpec", directory: Path | None = None) -> int:
    return _build(spec, directory)[0]


def _build(spec: "LibrarySpec", directory: Path | None) -> tuple[int, bool]:
    """An open descriptor of the checked library of `spec` in `directory` (this user's library_dir()
    by default), compiled there first if missing or untrustworthy; the caller closes it.

    Checks before anything is loaded: the directory is a real directory owned by this user and
    writable by nobody else (else NativeUnavailable, see `trusted_dir`); the library is a regular
    file (not a symlink) owned by this user and writable by nobody else, or it is rebuilt and
    renamed over. The descriptor is the checked file itself, so it cannot be swapped afterwards.
    A cached library shorter than its ELF header says (a crash or a full disk before builds
    fsynced) is rebuilt too: it failed to load for good, or faulted the process (SIGBUS) in dlopen.
    (_build also says whether it compiled.)"""
    directory = directory or library_dir()
    dir_fd = trusted_dir(directory)
    try:
        # every call, not only before a compile: once the library exists nothing compiles here
        # again, and a build killed before that would otherwise leave its folder for good
        _sweep_dead_builds(dir_fd)
        fd = _open_trusted(dir_fd, spec.name)
        if fd is not None and _cut_short(fd):
            os.close(fd)
            fd = None
        compiled = fd is None
        if compiled:
            _compile(dir_fd, directory, spec)
            fd = _open_trusted(dir_fd, spec.name)
            if fd is None:
                raise NativeUnavailable(f"{directory / spec.name} was rebuilt but does not pass the checks "
                                        f"(regular file, owned by this user, writable by nobody else)")
        return fd, compiled
    finally:
        os.close(dir_fd)


def _cut_short(fd: int) -> bool:
    """Whether the library behind `fd` is shorter than its own ELF header says (or has none): what a
    crash or a full disk leaves of a write that was not fsynced."""
    import struct

    try:
        header = os.pread(fd, 64, 0)
        size = os.fstat(fd).st_size
    except OSError:
        return False
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:  # not a whole 64-bit ELF header
        return True
    (section_headers,) = struct.unpack_from("<Q", header, 0x28)
    entry_size, entries = struct.unpack_from("<HH", header, 0x3A)
    return size < section_headers + entry_size * entries


def load(fd: int, path: Path) -> ctypes.CDLL:
    """dlopen the file behind `fd`: through /proc/self/fd, so the file checked is the one loaded even
    if someone renames directories above it in between.

    glibc hands back a library already loaded under the same path, so the path must never name two
    libraries: the descriptor is duplicated and the duplicate kept open for the life of the process
    (its number is never reused), and that is the path loaded."""
    try:
        kept = os.dup(fd)
    except OSError as err:
        raise _out_of_descriptors(path, err) or NativeUnavailable(f"could not load {path}: {err}") from None
    via_fd = f"/proc/self/fd/{kept}"
    try:
        library = ctypes.CDLL(via_fd if os.path.exists(via_fd) else str(path))
    except OSError as err:
        os.close(kept)  # nothing was loaded through it
        if "Too many open files" in str(err):  # dlopen's text only: its OSError carries no errno
            raise OutOfDescriptors(f"could not load {path}: {err}: the open-files limit (`ulimit -n`) was "
                                   f"reached; raise it") from None
        if _mounted_noexec(path.parent):  # dlopen says "failed to map segment from shared object"
            raise NoExecCache(f"could not load {path}: {err}: {path.parent} is on a filesystem mounted noexec, "
                              f"where no library can be loaded; point CORELAUNCH_CACHE at a directory on a "
                              f"filesystem that allows executing files") from None
        raise NativeUnavailable(f"could not load {path}: {err}") from None
    _KEPT_OPEN.append(kept)
    return library


def build_and_load(spec: "LibrarySpec", directory: Path | None = None) -> ctypes.CDLL:
    """`build`, then `load`: the checked library of `spec`, compiled first where needed (in this
    user's library_dir() by default). Raises NativeUnavailable; the caller declares the argtypes."""
    directory = directory or library_dir()
    fd, compiled = _build(spec, directory)
    try:
        return load(fd, Path(directory) / spec.name)
    except NativeUnavailable as err:
        if compiled or isinstance(err, (OutOfDescriptors, NoExecCache)):  # nothing says the file is damaged
            raise
        # A cached file of full length that does not load (damaged on disk, say): not rebuilt at
        # every start of every rank, which a cache that can never load (noexec) would cost.
        raise NativeUnavailable(f"{err}; if {Path(directory) / spec.name} is damaged, delete it and it is "
                                f"built again at the next start") from None
    finally:
        os.close(fd)


_KEPT_OPEN: list[int] = []
"""Descriptors of loaded libraries (see `load`)."""


def _mounted_noexec(directory: Path) -> bool:
    """Whether `directory` is on a filesystem mounted noexec (False when that cannot be told)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_NOEXEC)
    except OSError:
        return False


def torch_operator_spec(stem: str, c_source: str, operator_source: str, flags: tuple[str, ...],
                        what: str, identity: str) -> LibrarySpec:
    """A C kernel with the C++ body of its torch operator, built as C++ against the installed torch
    (headers and libraries), so that the operator's kernel registers itself when the library loads.
    `identity` names what the binary depends on besides the torch version (the host's CPU)."""
    import torch
    import torch.utils.cpp_extension as cpp

    torch_lib = str(Path(torch.__file__).parent / "lib")
    cxx_flags = (*flags, "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                 *(f"-I{path}" for path in cpp.include_paths()), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
                 f"-Wl,-rpath,{torch_lib}")
    source = 'extern "C" {\n' + c_source + '}\n' + operator_source
    return LibrarySpec(stem, source, cxx_flags, what, f"{identity}torch {torch.__version__}", language="c++")


def turned_off(env_var: str) -> bool:
    """`env_var`=0 in this process's environment: the switch that turns a native kernel off (1, unset
    or empty: on; anything else is refused, naming it)."""
    from shardlib.env_settings import switched_off

    return switched_off(env_var)


def load_unless_turned_off(env_var: str, build) -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None), or (None, why not): `env_var`=0 turns the library off, else `build()` gives
    the loaded library or the reason it could not be built."""
    if turned_off(env_var):
        return None, f"turned off by {env_var}=0"
    built = build()
    return (None, built) if isinstance(built, str) else (built, None)


def once_per_process(fn):
    """fn() cached for the process and run by one thread at a time: lru_cache alone lets two threads
    that ask first both run it (two compiles into an empty cache). cache_clear() as lru_cache's."""
    cached, lock = functools.lru_cache(maxsize=None)(fn), threading.Lock()

    @functools.wraps(fn)
    def wrapper():
        with lock:
            return cached()

    wrapper.cache_clear = cached.cache_clear
    return wrapper
