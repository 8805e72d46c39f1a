"""The native kernels' cache where no home directory can be found (workers/native_build.py library_dir).

With CORELAUNCH_CACHE and HOME unset, a uid without a passwd entry (a container run as an arbitrary
uid) has no home: Path.home() raises RuntimeError. The kernels' loaders catch NativeUnavailable
alone, so that error failed the model load instead of the documented fall back to torch's paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import native_build
from workers.kernels import prefill_attention
from workers.native_build import NativeUnavailable


@pytest.fixture
def no_home(monkeypatch):
    monkeypatch.delenv("CORELAUNCH_CACHE", raising=False)
    monkeypatch.delenv("HOME", raising=False)

    def home():  # what pathlib says for a uid without a passwd entry and no $HOME
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(home))


def test_library_dir_without_a_home_is_unavailable_naming_corelaunch_cache(no_home):
    with pytest.raises(NativeUnavailable, match="set CORELAUNCH_CACHE") as raised:
        native_build.library_dir()
    assert "home directory is unknown (Could not determine home directory.)" in str(raised.value)


def test_a_kernel_loader_without_a_home_falls_back_with_the_reason(no_home):
    """The prefill attention kernel's host build (uncached: the real one may be loaded already) gives
    the reason it cannot be built, as it does for a missing compiler, rather than raising."""
    uncached_host_build = prefill_attention._host_build.__wrapped__  # once_per_process keeps fn there
    reason = uncached_host_build()
    assert isinstance(reason, str) and "CORELAUNCH_CACHE" in reason, reason
