"""When a native kernel's tests may be skipped: only where the kernel is turned off (its
`CORELAUNCH_...=0`) or the host has no compiler for it. A kernel that fails to build on a host that
has one made its tests skip (and the run pass) while every model ran without it; its tests now run
and fail, and tests/test_native_kernels_build.py names the build error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def absence_expected(reason: str | None) -> bool:
    """Whether a kernel's unavailable_reason is a choice or a missing compiler, not a failed build."""
    return reason is not None and (reason.startswith("turned off by") or " compiler found (" in reason)


def skip_unless_built(kernel, what: str = "kernel"):
    """pytestmark for a kernel module's tests (it has available() and unavailable_reason)."""
    return pytest.mark.skipif(not kernel.available() and absence_expected(kernel.unavailable_reason),
                              reason=f"{what} unavailable: {kernel.unavailable_reason}")


def last_line_of_a_fresh_process(script: str) -> str:
    """The last line a new Python process running `script` from the repository root prints (it must
    exit 0): for what only a process that never loaded a kernel, or never set the tracing marks
    workers/compiled.py sets, can show."""
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split("\n")[-2]
