"""corelaunch's environment variables that choose a rank's code paths, parsed in one place.

The ranks read them where they run (workers/); the driver checks the same values before any process
starts (launcher/launch_plan.py). Before, a bad choice was named only once Ray had started and a
rank loaded (30-40 s on 2 cores), a CORELAUNCH_COLLECTIVES typo not at all at TP 1 (a single rank
has no collectives), and an on/off switch set to anything but `0` (`off`, `false`, `no`) was
silently on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

COLLECTIVES = "CORELAUNCH_COLLECTIVES"
COLLECTIVES_MODES = ("auto", "gloo", "shm")
PREFILL_GEMM = "CORELAUNCH_PREFILL_GEMM"
PREFILL_GEMMS = ("packed", "onednn", "mkl")
KERNEL_SWITCHES = ("CORELAUNCH_PACKED_WEIGHTS", "CORELAUNCH_DECODE_ATTENTION", "CORELAUNCH_PREFILL_ATTENTION",
                   "CORELAUNCH_SMALL_LINEAR")
"""On (1, the default) or off (0): each turns one native kernel off."""


def choice(name: str, allowed: tuple[str, ...], environ: Mapping[str, str] = os.environ) -> str | None:
    """The variable's value, trimmed and lower-cased; None where it is unset or empty (the default);
    ValueError naming the value and the allowed ones otherwise."""
    value = environ.get(name, "").strip().lower()
    if not value:
        return None
    if value not in allowed:
        raise ValueError(f"{name}={environ[name]!r} is not one of {', '.join(allowed)}; fix or unset it")
    return value


def switched_off(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """True for `0`; False for `1`, unset or empty; ValueError naming the value otherwise."""
    value = environ.get(name, "").strip()
    if value in ("", "1"):
        return False
    if value == "0":
        return True
    raise ValueError(f"{name}={environ[name]!r} is neither 0 (off) nor 1 (on, the default); fix or unset it")


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """ValueError for the first of corelaunch's variables set to a value it does not take."""
    choice(COLLECTIVES, COLLECTIVES_MODES, environ)
    choice(PREFILL_GEMM, PREFILL_GEMMS, environ)
    for name in KERNEL_SWITCHES:
        switched_off(name, environ)
