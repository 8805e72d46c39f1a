"""One compile per graph on a host: ranks that trace the same graph at once compile it once, the
others wait and take it from inductor's cache.

Why: the ranks of a TP group trace the same graphs (the same shapes, weights and rank-dependent
values as inputs, the same collective handles), and ranks on one host share inductor's cache
directory. Compiled side by side, each rank spent the same seconds of inductor's single-threaded
Python on each graph: at TP 2 on two cores both cores compiled, at TP 3 three compiles shared two
cores, and replicas on one host compiled everything once each. Here the compile of a traced graph
(dynamo's backend call) runs under a lock file named after the graph, in the cache directory: the
first rank to reach it takes it exclusively and compiles; a rank that finds it taken waits until
it is released, then finds the graph in the cache. Measured in the README (Compiled graphs and
buckets).

Never a deadlock: the lock covers inductor's compile only, never running a graph, so no collective
runs under it and no rank waits on a rank that waits on it. A rank that dies releases its lock
(flock). Graphs that differ between ranks have different locks and compile side by side, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

LOCK_FOLDER = "corelaunch-compile-locks"


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


def _misses() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"]


class CompileOnce:
    """A torch.compile backend: inductor's compile_fx, under the graph's host-wide lock."""

    compiler_name = "inductor"  # what dynamo treats it as (registry lookups, logs)

    def __init__(self) -> None:
        self.compiled_by_peer = 0
        """Graphs this process waited for another to compile (then found in the cache): its own
        cache counters count them as hits, though they were compiled just now."""

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        try:
            folder = _lock_folder()
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / f"{graph_key(gm, example_inputs)}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # no writable cache directory: compile as if alone
            return compile_fx(gm, example_inputs)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process is compiling this graph: wait for it (shared,
                fcntl.flock(fd, fcntl.LOCK_SH)  # so that all who waited take it from the cache at once)
                misses = _misses()
                compiled = compile_fx(gm, example_inputs)
                self.compiled_by_peer += _misses() == misses
                return compiled
            except OSError:  # a file system without locks (some network mounts): compile as if alone
                pass
            return compile_fx(gm, example_inputs)
        finally:
            os.close(fd)  # releases the lock
