"""When a native kernel's tests may be skipped: only where the kernel is turned off (its
`CORELAUNCH_...=0`) or the host has no compiler for it. A kernel that fails to build on a host that
has one made its tests skip (and the run pass) while every model ran without it; its tests now run
and fail, and tests/test_native_kernels_build.py names the build error."""

from __future__ import annotations

import pytest


def absence_expected(reason: str | None) -> bool:
    """Whether a kernel's unavailable_reason is a choice or a missing compiler, not a failed build."""
    return reason is not None and (reason.startswith("turned off by") or " compiler found (" in reason)


def skip_unless_built(kernel, what: str = "kernel"):
    """pytestmark for a kernel module's tests (it has available() and unavailable_reason)."""
    return pytest.mark.skipif(not kernel.available() and absence_expected(kernel.unavailable_reason),
                              reason=f"{what} unavailable: {kernel.unavailable_reason}")
