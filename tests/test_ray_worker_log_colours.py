"""Ray's forwarded worker lines in a log file (launcher/cluster/ray_cluster.py): Ray wraps each
line's `(rank 0 pid=...)` prefix in ANSI colour codes unless RAY_COLOR_PREFIX=0 is in the driver's
environment, so a redirected `corelaunch generate` wrote ESC[36m...ESC[0m into its log. No Ray is
started here: ray.init records the environment it was called with and stops the connect."""

from __future__ import annotations

import io
import os
import sys

import pytest


class _Stopped(BaseException):
    """Raised by the stand-in ray.init: nothing after it runs, and no handler of Exception takes it."""


def _environment_at_ray_init(monkeypatch, tmp_path, stderr) -> dict:
    import ray

    from launcher.cluster import ray_cluster

    seen = {}

    def init(**options):
        seen.update(os.environ)
        raise _Stopped

    monkeypatch.setenv("HOME", str(tmp_path))  # the token folder connect() tightens: a scratch one
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(_Stopped):
        ray_cluster.connect("local", num_cpus=1, worker_logs=True)
    return seen


def _unset_for_this_test(monkeypatch, name: str) -> None:
    """Unset, and unset again afterwards: delenv of an unset variable records nothing to undo, so
    the value connect() sets would outlive the test."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_worker_lines_into_a_log_carry_no_colour_codes(monkeypatch, tmp_path):
    _unset_for_this_test(monkeypatch, "RAY_COLOR_PREFIX")
    assert _environment_at_ray_init(monkeypatch, tmp_path, io.StringIO()).get("RAY_COLOR_PREFIX") == "0"


def test_a_terminal_keeps_rays_colours(monkeypatch, tmp_path):
    _unset_for_this_test(monkeypatch, "RAY_COLOR_PREFIX")
    assert "RAY_COLOR_PREFIX" not in _environment_at_ray_init(monkeypatch, tmp_path, _Terminal())


def test_the_users_own_setting_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    assert _environment_at_ray_init(monkeypatch, tmp_path, io.StringIO())["RAY_COLOR_PREFIX"] == "1"
