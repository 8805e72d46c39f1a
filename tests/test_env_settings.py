"""shardlib/env_settings.py: corelaunch's environment variables parsed once for the ranks and
checked by the driver before anything starts. An on/off switch set to `off` was silently on, a
collectives typo passed at TP 1, and every bad value was named only after Ray and a rank started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlib.env_settings import (COLLECTIVES, COLLECTIVES_MODES, KERNEL_SWITCHES, PREFILL_GEMM, check_environment,
                                   choice, switched_off)
from workers.native_build import turned_off

REPO = Path(__file__).parent.parent


def test_a_choice_is_trimmed_and_lower_cased_and_unset_or_empty_is_the_default():
    assert choice(COLLECTIVES, COLLECTIVES_MODES, {}) is None
    assert choice(COLLECTIVES, COLLECTIVES_MODES, {COLLECTIVES: "  "}) is None
    assert choice(COLLECTIVES, COLLECTIVES_MODES, {COLLECTIVES: " SHM "}) == "shm"
    assert choice(PREFILL_GEMM, ("onednn", "mkl"), {PREFILL_GEMM: "MKL"}) == "mkl"  # refused before: case-sensitive
    with pytest.raises(ValueError, match=r"CORELAUNCH_COLLECTIVES='nccl' is not one of auto, gloo, shm; fix or unset"):
        choice(COLLECTIVES, COLLECTIVES_MODES, {COLLECTIVES: "nccl"})


@pytest.mark.parametrize("value, off", [("0", True), (" 0 ", True), ("1", False), ("", False), (None, False)])
def test_a_switch_is_off_at_0_and_on_at_1_unset_or_empty(value, off):
    environ = {} if value is None else {"CORELAUNCH_PACKED_WEIGHTS": value}
    assert switched_off("CORELAUNCH_PACKED_WEIGHTS", environ) is off


@pytest.mark.parametrize("name", KERNEL_SWITCHES)
@pytest.mark.parametrize("value", ["off", "false", "no", "yes", "2"])
def test_a_switch_set_to_anything_else_is_refused_naming_it(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}' is neither 0 \(off\) nor 1 \(on, the default\)"):
        turned_off(name)  # what the ranks call: `off` was read as on
    with pytest.raises(ValueError, match=rf"{name}='{value}'"):
        check_environment()


@pytest.mark.parametrize("name, value", [(COLLECTIVES, "nccl"), (PREFILL_GEMM, "cublas"),
                                         ("CORELAUNCH_SMALL_LINEAR", "off")])
def test_the_driver_refuses_a_bad_value_before_ray_starts(name, value):
    """`generate` at TP 1 (where the collectives variable was never read): exit 2, one line, and
    the command never reached Ray."""
    env = {**os.environ, name: value}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-m", "launcher", "generate", "--prompt", "hi", "--max-new-tokens", "1"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert run.returncode == 2, run.stderr
    assert f"{name}={value!r}" in run.stderr and "connecting to Ray" not in run.stderr, run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("corelaunch")] == run.stderr.splitlines()[-1:]
