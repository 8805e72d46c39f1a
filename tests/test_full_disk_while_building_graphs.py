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


IN_PROCESS_CLI = ("import sys, pytest\n"
                  "from tests.in_process_cluster import use_in_process_groups\n"
                  "use_in_process_groups(pytest.MonkeyPatch())\n"
                  "from launcher.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.skipif(not _can_mount_a_private_tmpfs(), reason="needs `unshare` to mount a private tmpfs")
def test_compile_onto_a_disk_that_fills_while_building_the_graphs_names_out_and_exits_2(tmp_path):
    """A 160 KiB tmpfs holds the weights (about 30 KiB), the model's files and the manifest, not
    the compile cache (inductor's C++ sources and shared libraries, hundreds of KiB)."""
    model = save_model(build_random_model(seed=3, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=1), tmp_path / "model")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "cf"
    compile_into_the_small_disk = subprocess.list2cmdline(
        [sys.executable, "-c", IN_PROCESS_CLI, "compile", "--model", str(model), "--out", str(out),
         "--buckets", "16", "--max-num-seqs", "1", "--quiet"])
    # the mount lives as long as the namespace: what the compile left is listed before it ends
    script = (f"mount -t tmpfs -o size=160k tmpfs {disk} && {compile_into_the_small_disk}; code=$?; "
              f"echo left: $(ls -A {disk}); exit $code")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, CORELAUNCH_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
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
