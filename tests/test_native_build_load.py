"""A native library (kernels, collectives) that cannot be loaded says why, and the fix fits the cause."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


WITHOUT_DESCRIPTORS = """
import os, resource, sys, torch
from pathlib import Path
from workers.native_build import NativeUnavailable, load, trusted_dir
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
library = Path(torch.__file__).parent / "lib" / "libc10.so"
fd = os.open(library, os.O_RDONLY)
cache = Path(sys.argv[1])
os.close(trusted_dir(cache))  # made and checked while descriptors are free
taken = []
try:
    while True:
        taken.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
def tell(call):
    try:
        call()
    except NativeUnavailable as err:
        print(err)
tell(lambda: trusted_dir(cache))  # none free
tell(lambda: load(fd, library))
os.close(taken.pop())
tell(lambda: trusted_dir(cache))  # one free: the parent opens, the folder does not
tell(lambda: load(fd, library))  # its dup takes the one left, and dlopen finds none
"""


def test_a_cache_or_library_short_of_descriptors_is_not_called_untrusted_or_damaged(tmp_path):
    """Under a low `ulimit -n` a cache folder that exists and is this user's was refused as one another
    user could have planted code in ("Remove ..."), and a cached kernel that failed to load was said
    to be maybe damaged, to be deleted; the cause was the limit. (A subprocess with a limit of 128:
    the test takes every free descriptor.)"""
    done = subprocess.run([sys.executable, "-c", WITHOUT_DESCRIPTORS, str(tmp_path / "cache")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    told = done.stdout.splitlines()
    assert len(told) == 4, done.stdout + done.stderr[-2000:]
    assert all("the open-files limit (`ulimit -n`) was reached; raise it" in line for line in told), told
    assert not any("Another user" in line or "damaged" in line for line in told), told
    assert "Too many open files" in told[3] and told[3].startswith("could not load "), told


KILLED_WHILE_COMPILING = """
import sys
from pathlib import Path
from workers.native_build import LibrarySpec, build
build(LibrarySpec(stem="probe", source="int probe(void) { return 7; }", flags=(), what="a probe"), Path(sys.argv[1]))
"""


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_a_build_killed_while_compiling_leaves_nothing_in_tmpdir_and_the_next_build_sweeps_it(tmp_path):
    """A rank killed while it compiled a kernel (SIGKILL, or Ray's SIGTERM handler, which ends the
    process without unwinding the compute thread that builds) left its temporary folder in $TMPDIR
    for good. The folder is now in the cache, named after its writer, and the next build on this
    host removes it; a folder whose writer still runs, or runs on another host, is kept."""
    from shardlib.process_alive import writer_tag
    from workers.native_build import LibrarySpec, build

    cache, tmpdir = tmp_path / "cache", tmp_path / "tmp"
    tmpdir.mkdir()
    slow_cc = tmp_path / "slow-cc"
    slow_cc.write_text("#!/bin/sh\nsleep 60\n")
    slow_cc.chmod(0o755)
    child = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_COMPILING, str(cache)], cwd=REPO,
                             env={**os.environ, "CC": str(slow_cc), "TMPDIR": str(tmpdir)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list(cache.glob(".build-*/source.c")) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert list(cache.glob(".build-*/source.c")), "the build never started"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    left = list(cache.glob(".build-*"))
    assert len(left) == 1 and left[0].name.startswith(f".build-{writer_tag().rsplit('-', 1)[0]}-{child.pid}-"), left
    assert not list(tmpdir.iterdir())
    running_here = cache / f".build-{writer_tag()}-0000aaaa"  # this process: it still runs
    other_host = cache / ".build-otherhost-1-0000bbbb"
    other_host_old = cache / ".build-otherhost-2-0000cccc"  # a day old: no build takes that long
    for folder in (running_here, other_host, other_host_old):
        folder.mkdir()
    day_ago = time.time() - 25 * 3600
    os.utime(other_host_old, (day_ago, day_ago))
    spec = LibrarySpec(stem="probe", source="int probe(void) { return 7; }", flags=(), what="a probe")
    os.close(build(spec, cache))
    assert (cache / spec.name).is_file()
    assert sorted(p.name for p in cache.glob(".build-*")) == sorted([running_here.name, other_host.name])
