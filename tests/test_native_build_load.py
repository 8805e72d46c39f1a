"""A native library (kernels, collectives) that cannot be loaded says why, and the fix fits the cause."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


LOAD_WITHOUT_DESCRIPTORS = """
import os, torch
from pathlib import Path
from workers.native_build import NativeUnavailable, load
library = Path(torch.__file__).parent / "lib" / "libc10.so"
fd = os.open(library, os.O_RDONLY)
taken = []
try:
    while True:
        taken.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    os.close(taken.pop())  # one left: load's own dup takes it, and dlopen finds none
try:
    load(fd, library)
except NativeUnavailable as err:
    print(err)
"""


def test_a_library_that_cannot_load_for_want_of_descriptors_is_not_called_damaged():
    """Under a low `ulimit -n` a cached kernel that failed to load was said to be maybe damaged, to
    be deleted; the cause was the limit. (A subprocess: the test takes every free descriptor.)"""
    done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_DESCRIPTORS], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Too many open files: this process reached its open-files limit (`ulimit -n`); raise it" in done.stdout, \
        done.stdout + done.stderr[-2000:]
