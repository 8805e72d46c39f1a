"""A full disk while `corelaunch compile`'s ranks build the graphs: the ranks write nothing but the
compile cache, which lives inside --out, yet the failure came back as "rank 0 failed to load its
shard: OSError: [Errno 28] ..." (or the linker's "ld: final link failed: No space left on device"
inside a C++ compile error), exit 3, instead of the "could not write --out" refusal, exit 2, a full
disk during the weights' write gets. The phase was misnamed too: the shard had loaded.

The end-to-end case fills a real tmpfs (a private mount namespace: `unshare`), so the errno is the
kernel's ENOSPC, not a file size limit's EFBIG."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray.exceptions
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import CppCompileError, InductorError

from launcher.cluster.tp_group import LOAD_AND_BUILD_STEP, LOAD_STEP, RankWriteRefused, _rank_failure
from launcher.errors import RankFailed
from tests.model_factory import build_random_model, save_model

REPO = Path(__file__).resolve().parents[1]
WHERE = "rank 0 (node 10.0.0.1, pid 7)"
FULL = os.strerror(errno.ENOSPC)


def _inductor_error_of(inner: OSError) -> InductorError:
    """An InductorError raised from `inner`, as inductor raises it when its cache write fails."""
    try:
        try:
            raise inner
        except OSError as err:
            raise InductorError(err, None) from err
    except InductorError as wrapped:
        return wrapped


def test_a_cache_write_refused_while_building_graphs_is_a_write_refusal_naming_the_phase():
    failure = _rank_failure(WHERE, LOAD_STEP, _inductor_error_of(OSError(errno.ENOSPC, FULL)))
    assert isinstance(failure, RankWriteRefused) and failure.write_errno == errno.ENOSPC, repr(failure)
    assert failure.building_graphs
    assert str(failure).startswith(f"{WHERE} failed to build its graphs: "), str(failure)


def test_the_errno_is_found_in_rays_copy_which_keeps_the_text_but_not_the_chain():
    """Ray pickles the rank's exception: __cause__ is lost, the words stay."""
    copied = pickle.loads(pickle.dumps(_inductor_error_of(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))))
    assert copied.__cause__ is None
    remote = ray.exceptions.RayTaskError("RankWorker.load", "Traceback (most recent call last): ...", copied)
    failure = _rank_failure(WHERE, LOAD_AND_BUILD_STEP, remote)
    assert isinstance(failure, RankWriteRefused) and failure.write_errno == errno.EDQUOT, repr(failure)
    assert f"failed to build its graphs: OSError: [Errno {errno.EDQUOT}]" in str(failure), str(failure)


def test_the_linkers_full_disk_is_found_in_the_compile_errors_output():
    """No OSError at all: ld reports it, inductor raises CppCompileError with ld's output."""
    linker = CppCompileError(["g++", "k.cpp", "-o", "k.so"], f"/usr/bin/ld: final link failed: {FULL}\n")
    failure = _rank_failure(WHERE, LOAD_STEP, linker)
    assert isinstance(failure, RankWriteRefused) and failure.write_errno == errno.ENOSPC, repr(failure)


def test_dynamos_wrapper_of_the_cache_write_is_a_graph_build():
    inner = OSError(errno.ENOSPC, FULL)
    try:
        raise BackendCompilerFailed("compile_once", inner, None) from inner
    except BackendCompilerFailed as err:
        failure = _rank_failure(WHERE, LOAD_STEP, err)
    assert isinstance(failure, RankWriteRefused) and failure.write_errno == errno.ENOSPC, repr(failure)
    assert "failed to build its graphs" in str(failure), str(failure)


def test_only_the_graph_builders_words_are_read_and_the_load_phase_keeps_its_name():
    """A rank's other error quoting the words is not a write refusal; a load's own error still says
    it failed to load its shard."""
    failure = _rank_failure(WHERE, LOAD_STEP, RuntimeError(f"peer said: {FULL}"))
    assert type(failure) is RankFailed, repr(failure)
    assert str(failure).startswith(f"{WHERE} failed to load its shard: peer said"), str(failure)


def test_a_ranks_own_refused_write_is_a_write_refusal_outside_graph_building():
    failure = _rank_failure(WHERE, "serve", OSError(errno.EFBIG, os.strerror(errno.EFBIG)))
    assert isinstance(failure, RankWriteRefused) and not failure.building_graphs, repr(failure)
    assert failure.write_errno == errno.EFBIG and "failed to serve" in str(failure), str(failure)


def _can_mount_a_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, timeout=30)
    return done.returncode == 0


# The rank's load builds the graphs (--warm-up): on a loaded 2-core host a cold first graph (inductor's
# precompiled headers included) took most of the harness's default 120 s step limit. 400 s, and the
# subprocess's 500 s, stay under pytest's own 600 s, so a slow host fails with the compile's words.
IN_PROCESS_CLI = ("import sys, pytest\n"
                  "from tests.in_process_cluster import use_in_process_groups\n"
                  "use_in_process_groups(pytest.MonkeyPatch(), step_limit_s=400)\n"
                  "from launcher.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")

DISK = "96k"
"""The private tmpfs: room for what the compile writes before any graph (the weights, about 28 KiB,
the model's files, the manifests, the compile log: 52 KiB in 4 KiB pages, measured), not for the
first graph's cache entries (its FX-graph entry alone is about 100 KiB)."""


def _private_cache_with_the_native_kernels(cache: Path) -> Path:
    """A CORELAUNCH_CACHE of the test's own holding this host's built native kernels (packed linear,
    prefill and decode attention), which are not the subject. The rank loads them before any graph;
    with an empty cache it built all three from source inside the load, and on a loaded host ran out
    of the harness's step limit before a graph was built. Built here (a no-op when another test has),
    in the session's cache, then copied."""
    from workers.kernels import decode_attention, packed_linear, prefill_attention
    from workers.native_build import library_dir

    for kernel in (packed_linear, prefill_attention, decode_attention):
        assert kernel.available(), f"{kernel.__name__} did not build on this host: its own tests say why"
    # under the name the compile looks for: it runs as uid 0 in its user namespace (--map-root-user),
    # where this user's files show as uid 0's, so the folder's trust check passes there too
    shutil.copytree(library_dir(), cache / "native-uid0")  # modes kept: 0700, as the rank checks
    return cache


@pytest.mark.skipif(not _can_mount_a_private_tmpfs(), reason="needs `unshare` to mount a private tmpfs")
def test_compile_onto_a_disk_that_fills_while_building_the_graphs_names_out_and_exits_2(tmp_path):
    """The weights fit the small tmpfs; the compile cache inside --out (inductor's generated sources,
    FX-graph entries and shared libraries) does not. Everything else the compile writes (the native
    kernels, inductor's precompiled headers) goes to CORELAUNCH_CACHE on another disk."""
    model = save_model(build_random_model(seed=3, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=1), tmp_path / "model")
    cache = _private_cache_with_the_native_kernels(tmp_path / "cache")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "cf"
    compile_into_the_small_disk = subprocess.list2cmdline(
        [sys.executable, "-c", IN_PROCESS_CLI, "compile", "--model", str(model), "--out", str(out),
         "--buckets", "16", "--max-num-seqs", "1"])
    # the mount lives as long as the namespace: what the compile left is listed before it ends
    script = (f"mount -t tmpfs -o size={DISK} tmpfs {disk} && {compile_into_the_small_disk}; code=$?; "
              f"echo left: $(ls -A {disk}); exit $code")
    # torch's default in TORCHINDUCTOR_CACHE_DIR, as a parent that imported inductor passes it on: a
    # compile started with it built its graphs outside --out before the prefetch thread and the
    # rank's thread took turns with the variable (workers/inductor_cache.py), and filled no disk
    from workers.inductor_cache import torchs_default_folder

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=torchs_default_folder())
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=500, env=dict(env, CORELAUNCH_CACHE=str(cache)))
    # Without --quiet the steps are on stderr: a compile that never filled the disk shows its graphs built.
    assert done.returncode == 2 and "Traceback" not in done.stderr, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    assert "building 2 graph(s) per rank" in done.stderr, done.stderr[-3000:]  # the weights were written first
    assert done.stderr.splitlines()[-1] == (
        f"corelaunch compile: could not write --out {out} ({FULL} while building the graphs into its cache); "
        f"free space, or pass a path on another disk; if --out's disk has room, the full one may be the C++ "
        f"compiler's temporary folder ({tempfile.gettempdir()}): free space there, or set TMPDIR to a folder with "
        f"room"), done.stderr[-3000:]
    assert done.stdout.strip() == "left:", done.stdout  # the unfinished version removed


def test_the_refusal_survives_a_pickle_as_ray_copies_errors():
    """Ray copies an error by pickling it: the default pickling passed only the message, and the copy
    failed to unpickle (a Serve replica's failed start showed Ray's unpickling error instead)."""
    from launcher.cluster.tp_group import RankWriteRefused

    copied = pickle.loads(pickle.dumps(RankWriteRefused("rank 0 failed", errno.ENOSPC, True)))
    assert (str(copied), copied.write_errno, copied.building_graphs) == ("rank 0 failed", errno.ENOSPC, True)
