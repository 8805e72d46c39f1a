"""A native library (kernels, collectives) that cannot be loaded says why, and the fix fits the cause."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
