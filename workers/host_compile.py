"""Ranks on one host compile each graph once: the torch.compile backend every compiled rank uses.

A TP group's ranks trace the same graphs at the same moments (every rank runs the same step at
the same shapes), and ranks on one host share inductor's cache directory. Left alone, each rank
compiles every graph itself, all at once: on a host with fewer cores than ranks (2 cores, TP 2 or
3, the test suite's case) they fight for the cores, and even with a core each they repeat the same
work and hold the compiler's memory several times over.

This backend takes a host-wide lock per graph (an flock on a file in the cache directory, named by
the graph's code and input shapes) around inductor's compile. The first rank to get there compiles
and writes the cache; the others wait for the lock and then find the graph in the cache (an FX-graph
and AOTAutograd cache hit, well under a second for a layer graph). Graphs that differ between ranks
have different names and never wait for each other. Ranks whose graphs should match must trace
identical code: rank-specific numbers (the vocabulary rows a rank owns, its first expert) are
buffers, graph inputs, not constants baked into the code (workers/layers.py, workers/moe.py).

The lock only orders work; it never decides a result. A wait is bounded (LOCK_WAIT_S): past it the
rank compiles anyway, as it did before, and says so once on stderr. A rank that dies holding the
lock releases it with its file descriptor.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

LOCK_DIR = "corelaunch-graph-locks"
"""Folder of lock files inside the inductor cache directory (one empty file per graph)."""
LOCK_WAIT_S = 900.0
"""Longest a rank waits for another rank's compile of the same graph before compiling it itself:
longer than any one graph's compile seen (a whole-model graph of an 8B model on a loaded host)."""
_POLL_S = 0.05


def inductor_once_per_host(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """torch.compile backend: inductor's compile_fx, under this graph's host-wide lock."""
    from torch._inductor.compile_fx import compile_fx  # imported outside the lock: ranks import at once

    with graph_lock(graph_key(gm, example_inputs)):
        return compile_fx(gm, example_inputs)


def graph_key(gm: torch.fx.GraphModule, example_inputs: list) -> str:
    """Names one graph: its generated code and its inputs' shapes, strides and dtypes (not their
    values: weights are inputs). Equal on every rank that traces the same graph; two different
    graphs that collided would only wait for each other."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            digest.update(repr((tuple(value.shape), value.stride(), value.dtype, value.device.type)).encode())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()[:40]


def lock_dir() -> Path:
    """This process's inductor cache directory's lock folder (ranks sharing a cache share it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / LOCK_DIR


@contextlib.contextmanager
def graph_lock(key: str, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
    """Holds `key`'s host-wide lock inside the block; yields False (and holds nothing) when another
    process held it for longer than wait_s."""
    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield _acquire(fd, key, wait_s)
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, key: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                print(f"corelaunch: another process has been compiling graph {key[:12]} for over {wait_s:.0f} s; "
                      f"compiling it here as well", file=sys.stderr, flush=True)
                return False
            time.sleep(_POLL_S)
