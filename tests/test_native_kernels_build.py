"""Every native kernel builds on a host with a compiler (its tests skip only where it is turned
off or no compiler exists: tests/native_kernels.py)."""

from __future__ import annotations

import pytest

from tests.native_kernels import absence_expected
from workers.kernels import decode_attention, packed_linear, prefill_attention, small_linear


@pytest.mark.parametrize("kernel", [small_linear, packed_linear, decode_attention, prefill_attention],
                         ids=["small_linear", "packed_linear", "decode_attention", "prefill_attention"])
def test_every_kernel_builds_where_it_can(kernel):
    if not kernel.available() and absence_expected(kernel.unavailable_reason):
        pytest.skip(f"unavailable by choice or without a compiler: {kernel.unavailable_reason}")
    assert kernel.available(), kernel.unavailable_reason


def test_only_a_choice_or_a_missing_compiler_counts_as_an_expected_absence():
    assert absence_expected("turned off by CORELAUNCH_SMALL_LINEAR=0")
    assert absence_expected("no C compiler found (cc, gcc, clang or $CC); ...")
    assert not absence_expected("/bin/false failed to build the small-batch kernel:\nerror")
    assert not absence_expected(None)
