"""One compile per graph on a host: ranks that trace the same graph at once compile it once, the
others wait and take it from inductor's cache.

Why: the ranks of a TP group trace the same graphs (the same shapes, weights and the embedding's
vocabulary range as inputs, the same collective handles), and ranks on one host share inductor's
cache directory. Compiled side by side, each rank spent the same seconds of inductor's
single-threaded Python on each graph: at TP 2 on two cores both cores compiled, at TP 3 three
compiles shared two cores, and replicas on one host compiled everything once each. Here the compile
of a traced graph (dynamo's backend call) runs under a lock file named after the graph, in the cache
directory: the first rank to reach it takes it exclusively and compiles; a rank that finds it taken
waits until it is released, then finds the graph in the cache. Graphs that differ between ranks
(expert-parallel MoE layers hold their first expert as a constant) have different locks and compile
side by side, as before. Measured in the README (Compiled graphs and buckets).

Never a deadlock: the lock covers inductor's compile only, never running a graph, so no collective
runs under it and no rank waits on a rank that waits on it; dynamo compiles one graph at a time per
process, so a process never holds two. The lock is released explicitly (a process forked while it
was held, such as a compile worker, would otherwise keep it), a process that dies releases it, and
a rank waits at most WAIT_LIMIT_S before it compiles on its own (saying after
WAIT_NOTE_AFTER_S which lock it waits on, and its holder's pid where /proc/locks tells).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path

LOCK_FOLDER = "corelaunch-compile-locks"

WAIT_LIMIT_S = 900.0
"""How long a rank waits for another's compile of a graph before compiling it itself (with a line on
stderr): far past any single graph's compile, so only a stuck process is waited out."""

WAIT_NOTE_AFTER_S = 20.0
"""How long a rank waits for another's compile before saying so (once, on stderr, as its other
compile notes are said): a wait can outlast the request's own timeout, which named nothing else."""

POLL_S = 0.05

_PROCESS_START = time.time()


def graph_key(gm, example_inputs) -> str:
    """The same text for the same traced graph at the same input shapes in every process (a lock's
    name: two graphs sharing one would only wait for each other)."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        shape = getattr(value, "shape", None)
        stride = value.stride() if hasattr(value, "stride") else ()
        digest.update(repr((type(value).__name__, tuple(shape) if shape is not None else value,
                            str(getattr(value, "dtype", "")), tuple(stride))).encode())
    return digest.hexdigest()[:32]


def _lock_folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / LOCK_FOLDER


def _open_lock(path: Path) -> int | None:
    """The lock file's descriptor, or None where the name is not a regular file of this user's: a
    symlink is not followed (the mtime write below would land in its target) and a FIFO not waited
    on. (Its contents are no secret: any mode the user gave it is fine.)"""
    from workers.own_files import UntrustedEntry, open_own_entry

    try:
        # readable as the umask allows: a compiled-model directory's cache holds these, and another
        # user copying the directory (`cp -rL`) could not read a 0600 lock
        return open_own_entry(str(path), os.O_RDWR | os.O_CREAT, what="a compile lock", mode=0o666, private=False)
    except UntrustedEntry:
        return None


def _counter(name: str) -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"][name]


def _fx_cache_on() -> bool:
    from torch._inductor import config

    return bool(config.fx_graph_cache)


class CompileOnce:
    """A torch.compile backend: inductor's compile_fx, under the graph's host-wide lock. One per
    process (BACKEND): dynamo reuses a compiled graph only under the same backend object, so every
    model of a process must share it, as they shared torch.compile's own inductor backend."""

    __name__ = "compile_once"  # what dynamo calls it in logs

    def __init__(self) -> None:
        self.compiled_by_peer = 0
        """Graphs this process found in the cache that another process compiled while this one
        ran (its own cache counters count them as hits, though they were compiled just now)."""
        self._compiled_here: set[str] = set()

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        if not _fx_cache_on():  # nothing to share: a waiting rank would compile anyway
            return compile_fx(gm, example_inputs)
        try:
            folder = _lock_folder()
            folder.mkdir(parents=True, exist_ok=True)
            lock = folder / f"{graph_key(gm, example_inputs)}.lock"
            fd = _open_lock(lock)
        except OSError:  # no writable cache directory: compile as if alone
            return compile_fx(gm, example_inputs)
        if fd is None:  # not a lock file of this user's: never written to, compiled as if alone
            return compile_fx(gm, example_inputs)
        try:
            self._lock(fd, lock)
            hits, misses = _counter("fxgraph_cache_hit"), _counter("fxgraph_cache_miss")
            compiled = compile_fx(gm, example_inputs)
            if _counter("fxgraph_cache_miss") > misses:
                os.pwrite(fd, b"compiled", 0)  # the file's mtime: when this graph was last compiled
                self._compiled_here.add(lock.stem)
            elif (_counter("fxgraph_cache_hit") > hits and os.fstat(fd).st_mtime >= _PROCESS_START
                  and lock.stem not in self._compiled_here):
                self.compiled_by_peer += 1  # compiled by another process since this one started
            return compiled
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)

    @staticmethod
    def _lock(fd: int, path: Path) -> None:
        """Exclusive at once when free; else shared once the holder is done (so that all who waited
        read the cache at once), or nothing after WAIT_LIMIT_S; nothing on a file system without
        locks (some network mounts). A wait past WAIT_NOTE_AFTER_S is said once."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError:
            return
        start = time.monotonic()
        deadline, note_at = start + WAIT_LIMIT_S, start + WAIT_NOTE_AFTER_S
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if note_at is not None and time.monotonic() >= note_at:
                    _say_waiting(fd, path)
                    note_at = None
                time.sleep(POLL_S)
        print(f"corelaunch: waited {WAIT_LIMIT_S:.0f} s for another process's compile of a graph; "
              f"compiling it here", file=sys.stderr, flush=True)


def _say_waiting(fd: int, path: Path) -> None:
    holder = _holder_pid(fd)
    held_by = f", held by pid {holder}" if holder is not None else ""
    print(f"corelaunch: waiting for another process's compile of graph {path.stem} (lock {path}{held_by}); "
          f"up to {WAIT_LIMIT_S:.0f} s, then compiled here", file=sys.stderr, flush=True)


def _holder_pid(fd: int) -> int | None:
    """The pid holding a flock on the file behind `fd`, as /proc/locks tells it (None where it does
    not: no /proc, or a holder in another pid namespace, shown there as 0 or -1)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"; a waiter's line has "->" after the number
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK" or fields[5] != inode:
            continue
        if fields[4].isdigit() and int(fields[4]) > 0:
            return int(fields[4])
    return None


BACKEND = CompileOnce()
