"""One compile per graph on a host (workers/compile_once.py): a process that reaches a graph another
is compiling waits for it and takes it from inductor's cache; the ranks of a group trace the same
graphs, the vocabulary-parallel embedding included, so only one of them compiles each."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from workers.compile_once import LOCK_FOLDER, CompileOnce, graph_key

REPO = Path(__file__).resolve().parents[1]


def scaled_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 3 + 1).sum(dim=-1)


def keys_of(fn, *args) -> list[str]:
    """graph_key of every graph torch.compile traces from fn(*args) (the graphs run eagerly)."""
    keys = []

    def record(gm, example_inputs):
        keys.append(graph_key(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, dynamic=False)(*args)
    return keys


CHILD = """
import json, sys, torch
sys.path.insert(0, {repo!r})
from tests.test_compile_once import scaled_sum
from workers.compile_once import CompileOnce
from torch._dynamo.utils import counters
backend = CompileOnce()
out = torch.compile(scaled_sum, backend=backend, dynamic=False)(torch.ones(4, 8))
print(json.dumps({{"out": out.tolist(), "compiled_by_peer": backend.compiled_by_peer,
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "hit": counters["inductor"]["fxgraph_cache_hit"]}}))
"""


def run_child(cache: Path) -> subprocess.Popen:
    """A process that compiles scaled_sum with CompileOnce on `cache`; prints its counters as JSON."""
    return subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO))], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)})


def test_a_process_that_finds_the_graph_being_compiled_waits_and_takes_it_from_the_cache(tmp_path):
    cache = tmp_path / "inductor"
    [key] = keys_of(scaled_sum, torch.ones(4, 8))
    # The first compile in a fresh process too, as a rank's: what inductor's cache keeps for a graph
    # depends on the compiling process's torch thread count, which an earlier test in this one may
    # have set (the second process then missed the cache: a failure of the suite, not of the code)
    first = json.loads(run_child(cache).communicate(timeout=300)[0])  # nobody holds its lock
    assert first["miss"] > 0 and first["compiled_by_peer"] == 0 and first["out"] == [32.0] * 4
    lock = cache / LOCK_FOLDER / f"{key}.lock"
    assert lock.is_file()  # named by the graph's key

    # Now the lock is held, as by a rank still compiling: the next process waits for it ...
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        second = run_child(cache)
        deadline = time.monotonic() + 60
        while not _holds_open(second.pid, lock) and time.monotonic() < deadline:
            assert second.poll() is None, "the second process finished while the graph's lock was held"
            time.sleep(0.2)
        assert _holds_open(second.pid, lock), "the second process never reached the graph's lock"
        time.sleep(1.0)
        assert second.poll() is None, "the second process did not wait for the lock"
        os.pwrite(fd, b"compiled", 0)  # as the compiling rank stamps the lock file when it is done
    finally:
        os.close(fd)  # the "compile" is done
    # ... and then finds the graph in the cache (the same key in another process): a hit, counted
    # as compiled by a peer
    waited = json.loads(second.communicate(timeout=300)[0])
    assert waited["miss"] == 0 and waited["hit"] > 0 and waited["compiled_by_peer"] == 1
    assert waited["out"] == [32.0] * 4


def _holds_open(pid: int, path: Path) -> bool:
    """Whether the process has `path` open (the backend keeps a graph's lock file open while it
    waits for the lock and while it compiles)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) == str(path) for fd in fds.iterdir())
    except OSError:  # a descriptor closed while listing
        return False


def test_a_graph_nobody_else_holds_is_compiled_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    backend = CompileOnce()
    torch._dynamo.reset()
    out = torch.compile(lambda x: x.cos() * 2, backend=backend, dynamic=False)(torch.zeros(3))
    assert out.tolist() == [2.0, 2.0, 2.0] and backend.compiled_by_peer == 0
    assert len(list((tmp_path / "inductor" / LOCK_FOLDER).glob("*.lock"))) == 1


def test_every_rank_traces_the_same_embedding_graph():
    """The vocabulary range is an input of the graph, not a constant: ranks 0 and 1 trace one graph
    (with the range as Python ints, each rank's graph was its own and each rank compiled it)."""
    from workers.collectives import SingleRank
    from workers.layers import VocabParallelEmbedding

    ids = torch.tensor([[3, 70, 127, 5]])
    tables = torch.randn(2, 64, 8)
    embeddings = [VocabParallelEmbedding(tables[r], (64 * r, 64 * (r + 1)), torch.float32, SingleRank()) for r in (0, 1)]
    keys = [keys_of(embedding.forward, ids) for embedding in embeddings]
    assert keys[0] == keys[1] and len(keys[0]) == 1
    # and each rank still keeps only its own rows
    assert torch.equal(embeddings[0](ids)[0, 1], torch.zeros(8)) and torch.equal(embeddings[1](ids)[0, 1], tables[1][6])


@pytest.mark.parametrize("shape", [(4, 8), (5, 8)])
def test_another_shape_is_another_lock(shape):
    assert keys_of(scaled_sum, torch.ones(*shape)) != keys_of(scaled_sum, torch.ones(4, 9))


def _compile_again(cache_fn, monkeypatch, process_start: float) -> CompileOnce:
    """scaled_sum compiled by a fresh backend (as in another process started at process_start)."""
    import workers.compile_once as compile_once

    monkeypatch.setattr(compile_once, "_PROCESS_START", process_start)
    torch._dynamo.reset()
    backend = CompileOnce()
    assert torch.compile(scaled_sum, backend=backend, dynamic=False)(torch.ones(4, 8)).tolist() == [32.0] * 4
    return backend


def test_a_cache_hit_counts_as_compiled_by_a_peer_only_when_compiled_since_the_process_started(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    first = _compile_again(scaled_sum, monkeypatch, 0.0)  # a miss: compiled here, the lock file stamped
    assert first.compiled_by_peer == 0
    assert _compile_again(scaled_sum, monkeypatch, 0.0).compiled_by_peer == 1  # started before that compile
    assert _compile_again(scaled_sum, monkeypatch, time.time() + 1).compiled_by_peer == 0  # an earlier run's


def compile_while_its_lock_is_held(tmp_path):
    """(the graph's key, its lock file, the output) of scaled_sum compiled through CompileOnce while
    this process holds the graph's lock through another open file, never releasing it meanwhile."""
    [key] = keys_of(scaled_sum, torch.ones(4, 8))
    lock = tmp_path / "inductor" / LOCK_FOLDER / f"{key}.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        torch._dynamo.reset()
        out = torch.compile(scaled_sum, backend=CompileOnce(), dynamic=False)(torch.ones(4, 8))
    finally:
        os.close(fd)
    return key, lock, out


def test_a_stuck_holder_is_waited_for_at_most_the_limit(tmp_path, monkeypatch, capfd):
    import workers.compile_once as compile_once

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compile_once, "WAIT_LIMIT_S", 0.5)
    _, _, out = compile_while_its_lock_is_held(tmp_path)
    assert out.tolist() == [32.0] * 4
    assert "waited 0 s for another process's compile of a graph; compiling it here" in capfd.readouterr().err


def test_a_long_wait_names_the_lock_and_its_holder_once(tmp_path, monkeypatch, capfd):
    """A rank waiting on another process's compile said nothing for up to WAIT_LIMIT_S (15 minutes),
    past the default request timeout, which then named only itself."""
    import workers.compile_once as compile_once

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compile_once, "WAIT_NOTE_AFTER_S", 0.2, raising=False)  # older code: no note
    monkeypatch.setattr(compile_once, "WAIT_LIMIT_S", 1.5)
    key, lock, out = compile_while_its_lock_is_held(tmp_path)
    assert out.tolist() == [32.0] * 4
    err = capfd.readouterr().err
    note = f"corelaunch: waiting for another process's compile of graph {key} (lock {lock}"
    assert err.count(note) == 1, err
    if Path("/proc/locks").exists():
        assert f"{note}, held by pid {os.getpid()}); up to 2 s, then compiled here" in err, err


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_lock_name_someone_planted_is_neither_followed_nor_waited_on(tmp_path, monkeypatch, planted):
    """The lock's name is the graph's, which anyone can work out: a symlink planted there had the
    compile's mtime stamp ("compiled") written into its target, another user's file."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    [key] = keys_of(scaled_sum, torch.ones(4, 8))
    folder = tmp_path / "inductor" / LOCK_FOLDER
    folder.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    if planted == "symlink":
        (folder / f"{key}.lock").symlink_to(victim)
    else:
        os.mkfifo(folder / f"{key}.lock")
    torch._dynamo.reset()
    out = torch.compile(scaled_sum, backend=CompileOnce(), dynamic=False)(torch.ones(4, 8))
    assert out.tolist() == [32.0] * 4  # compiled as if alone
    assert victim.read_text() == "keep me"


def test_a_new_lock_is_readable_as_the_umask_allows(tmp_path):
    """A compiled-model directory's cache holds these locks: created 0600, another user copying the
    directory with `cp -rL` (what the refusal of an unwritable one advises) could not read them."""
    from workers.compile_once import _open_lock

    before = os.umask(0o022)
    try:
        fd = _open_lock(tmp_path / "a.lock")
    finally:
        os.umask(before)
    os.close(fd)
    assert (tmp_path / "a.lock").stat().st_mode & 0o777 == 0o644
