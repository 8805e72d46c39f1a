"""The few lines of C the shared-memory collectives need: publish a counter, wait for counters.

Why C and not Python: the data moves through torch (copies and adds on views of the segment), but
the hand-off between processes needs an atomic store with release order and loads with acquire
order, so that a peer that sees a counter also sees the data written before it. Python has no
atomics: plain stores happen to work on x86 (total store order) but not on Arm (Graviton hosts).
Python spinning also costs microseconds per check. These functions are compiled once with the
system C compiler (under a second, no torch headers) into this user's own directory of the
corelaunch cache ($CORELAUNCH_CACHE/native/uid<uid>, mode 0700) and loaded with ctypes, which
releases the GIL during the call. The cache may be shared, so nothing is loaded from a directory
or file another user owns or could write to (see `build`). Without a C compiler the CPU backend falls back
to gloo (see workers/shm/group.py).

Waiting is a brief spin, then yield, then sleep. A rank that busy-waits while its peer waits for
a core (more ranks than cores, e.g. TP 3 on 2 cores, or other work on the host) steals the very
time the peer needs: pure spinning measured 4-11 ms per all-reduce at TP 3 here, against ~0.1 ms
yielding. So after ~64 pauses (and `spin_s`, 0 by default, see workers/shm/group.py) the waiter
calls sched_yield, which returns at once when the core has nothing else to run, and after
`yield_s` it sleeps in 50 us naps.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

/* 1 when process `pid` is gone: no such process, or a zombie (exited, not yet reaped). */
static int process_gone(int32_t pid) {
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;  /* no /proc: trust kill() */
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[got] = 0;
    char *end = strrchr(buf, ')');  /* "pid (comm) S ...": the state follows the last ')' */
    return end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* Make every store this thread (and threads it joined) made before the call visible to a peer
   that reads `value` from `counter` with acquire order. */
void cl_publish(uint64_t *counter, uint64_t value) {
    __atomic_store_n(counter, value, __ATOMIC_RELEASE);
}

/* Wait until counters[i * stride] >= target for each i in 0 .. n-1 where wanted[i] != 0.
   Returns 0 when all have arrived, 1 on timeout, 2 when a peer's process has exited (pids[i] > 0;
   checked every 0.2 s once past the spin phase). missing[i] is set to 1 for each wanted
   counter that had not arrived when the call gave up, 0 otherwise. */
int cl_wait(uint64_t *counters, int stride, int n, const int32_t *wanted, uint64_t target,
            double spin_s, double yield_s, double timeout_s, const int32_t *pids,
            int32_t *missing) {
    double start = 0.0, next_liveness = 0.0;
    long spins = 0;
    struct timespec nap = {0, 50000};  /* 50 us */
    for (;;) {
        int all = 1;
        for (int i = 0; i < n; i++) {
            if (wanted[i] && __atomic_load_n(&counters[(long)i * stride], __ATOMIC_ACQUIRE) < target) {
                all = 0;
                break;
            }
        }
        if (all) return 0;
        if (spins++ < 64) {  /* the first few checks without even reading the clock */
            cpu_relax();
            continue;
        }
        double now = now_s();
        if (start == 0.0) {
            start = now;
            next_liveness = now + 0.2;
        }
        double waited = now - start;
        if (waited < spin_s) {
            for (int k = 0; k < 32; k++) cpu_relax();
            continue;
        }
        int status = 0;
        if (waited > timeout_s) status = 1;
        if (!status && now > next_liveness) {
            next_liveness = now + 0.2;
            for (int i = 0; i < n; i++)
                if (wanted[i] && pids[i] > 0 && process_gone(pids[i])
                    && __atomic_load_n(&counters[(long)i * stride], __ATOMIC_ACQUIRE) < target)
                    status = 2;
        }
        if (status) {
            for (int i = 0; i < n; i++)
                missing[i] = wanted[i] &&
                    __atomic_load_n(&counters[(long)i * stride], __ATOMIC_ACQUIRE) < target;
            return status;
        }
        if (waited < yield_s) sched_yield();
        else nanosleep(&nap, NULL);
    }
}
"""

_VERSION = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]


class NativeUnavailable(RuntimeError):
    """The C helpers could not be built or loaded (no compiler, read-only cache, untrusted cache, ...)."""


_NAME = f"corelaunch_shm_sync_{_VERSION}.so"
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def library_dir() -> Path:
    """This user's own directory for the compiled helpers: $CORELAUNCH_CACHE/native/uid<uid>.

    The cache may be shared by several users (CORELAUNCH_CACHE on a shared disk), so the library is
    never taken from a directory another user could write to; see `trusted_dir`."""
    from shardlib.demo_model import default_cache_dir

    return default_cache_dir() / "native" / f"uid{os.getuid()}"


def library_path() -> Path:
    """Where the compiled helpers live: one file per version of the source."""
    return library_dir() / _NAME


def _untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory (its fstat) must not be trusted, or None."""
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & _UNSAFE_BITS:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted_dir(directory: Path) -> int:
    """An open descriptor of `directory`, created with mode 0700 if missing, once checked to be a
    real directory (not a symlink) owned by this user and writable by nobody else.

    Raises NativeUnavailable naming the directory and the fix otherwise: a library placed there by
    another user would run inside every rank that loaded it."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise NativeUnavailable(f"could not create {directory.parent}: {err}") from None
    try:
        try:
            os.mkdir(directory.name, 0o700, dir_fd=parent)
            created = True
        except FileExistsError:
            created = False
        fd = os.open(directory.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError as err:
        why = str(err)
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY on a symlink
            try:
                if stat.S_ISLNK(os.stat(directory.name, dir_fd=parent, follow_symlinks=False).st_mode):
                    why = "it is a symlink"
            except OSError:
                pass
        raise NativeUnavailable(_refusal(directory, why)) from None
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if created and st.st_uid == os.getuid():
        os.fchmod(fd, 0o700)  # whatever the umask
        st = os.fstat(fd)
    why = _untrusted(st)
    if why:
        os.close(fd)
        raise NativeUnavailable(_refusal(directory, why))
    return fd


def _refusal(directory: Path, why: str) -> str:
    return (f"refusing to use {directory} for the shared-memory helper library: {why}. Another "
            f"user could place a library there that every rank would run. Remove {directory} (it "
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
    if not stat.S_ISREG(st.st_mode) or _untrusted(st):
        os.close(fd)
        return None
    return fd


def _compile(dir_fd: int, directory: Path, name: str) -> None:
    """Compile the helpers and move them into the trusted directory as `name`, atomically.

    The compiler writes into a private temporary directory; the bytes are then written to a fresh
    temporary name in the trusted directory (O_EXCL, mode 0700) and renamed over `name`, so
    concurrent ranks and launches never load a half-written library and the last rename wins
    with identical contents."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler found (cc, gcc or $CC); it builds the shared-memory "
                                "collectives' synchronisation helpers once")
    tmp_name = None
    try:
        with tempfile.TemporaryDirectory(prefix="corelaunch-native-") as tmp:
            src = Path(tmp) / "shm_sync.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / name
            proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise NativeUnavailable(f"{compiler} failed to build the shared-memory helpers:\n"
                                        f"{proc.stderr.strip()}")
            data = out.read_bytes()
        tmp_name = f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o700, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o700)  # whatever the umask (a group-writable library would be refused)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        tmp_name = None
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeUnavailable(f"could not build the shared-memory helpers in {directory}: {err}") from None
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name, dir_fd=dir_fd)
            except OSError:
                pass


def build(directory: Path | None = None) -> int:
    """An open descriptor of the checked helper library in `directory` (this user's library_dir()
    by default), compiled there first if missing or untrustworthy; the caller closes it.

    Checks before anything is loaded: the directory is a real directory owned by this user and
    writable by nobody else (else NativeUnavailable, see `trusted_dir`); the library is a regular
    file (not a symlink) owned by this user and writable by nobody else, or it is rebuilt and
    renamed over. The descriptor is the checked file itself, so it cannot be swapped afterwards."""
    directory = directory or library_dir()
    dir_fd = trusted_dir(directory)
    try:
        fd = _open_trusted(dir_fd, _NAME)
        if fd is None:
            _compile(dir_fd, directory, _NAME)
            fd = _open_trusted(dir_fd, _NAME)
            if fd is None:
                raise NativeUnavailable(f"{directory / _NAME} was rebuilt but does not pass the checks "
                                        f"(regular file, owned by this user, writable by nobody else)")
        return fd
    finally:
        os.close(dir_fd)


def _load(fd: int, path: Path) -> ctypes.CDLL:
    """dlopen the file behind `fd`: through /proc/self/fd, so the file checked is the one loaded even
    if someone renames directories above it in between. (glibc hands back a library already loaded
    under the same name; only checked helper libraries of this very source are ever loaded this
    way, so a reused descriptor number can only return one of those.)"""
    via_fd = f"/proc/self/fd/{fd}"
    try:
        return ctypes.CDLL(via_fd if os.path.exists(via_fd) else str(path))
    except OSError as err:
        raise NativeUnavailable(f"could not load {path}: {err}") from None


class Native:
    """ctypes bindings of the helpers (one instance per process is enough)."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = directory or library_dir()
        fd = build(directory)
        try:
            lib = _load(fd, directory / _NAME)
        finally:
            os.close(fd)
        u64p, i32p = ctypes.c_void_p, ctypes.c_void_p
        lib.cl_publish.argtypes = [u64p, ctypes.c_uint64]
        lib.cl_publish.restype = None
        lib.cl_wait.argtypes = [u64p, ctypes.c_int, ctypes.c_int, i32p, ctypes.c_uint64, ctypes.c_double,
                                ctypes.c_double, ctypes.c_double, i32p, i32p]
        lib.cl_wait.restype = ctypes.c_int
        self.publish = lib.cl_publish
        self.wait = lib.cl_wait


_native: Native | None = None


def native() -> Native:
    """The process-wide bindings, built on first use; raises NativeUnavailable."""
    global _native
    if _native is None:
        _native = Native()
    return _native
