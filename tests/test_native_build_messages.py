"""What a native kernel that cannot be built or loaded tells the user: a prefill kernel that failed
to build is named at load as the others are; CC/CXX may hold a command with arguments, as make
allows; a cache that cannot be written, or is mounted noexec, is named with the fix that helps."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

from workers import native_build
from workers.native_build import LibrarySpec, NativeUnavailable

PROBES = {"c": LibrarySpec("probe", "int probe(void) { return 7; }\n", (), "a probe"),
          "c++": LibrarySpec("probe", 'extern "C" int probe(void) { return 7; }\n', (), "a probe", language="c++")}
"""language -> a library with one function returning 7 (the C++ one compiled by $CXX)."""


def found_compiler(language: str) -> str | None:
    """The compiler native_build would find on PATH for `language`, or None."""
    return next(filter(None, map(shutil.which, native_build._COMPILERS[language][1])), None)


HAS_C, HAS_CXX = found_compiler("c") is not None, found_compiler("c++") is not None


def model_in(dtype: torch.dtype) -> torch.nn.Module:
    model = torch.nn.Module()
    model.dtype = dtype  # what ShardedCausalLM holds: its compute dtype
    return model


def prepare_eager(monkeypatch, model: torch.nn.Module) -> list[str]:
    """The RuntimeWarnings CpuBackend.prepare_model gives for `model` (eager), with the packed-weight
    kernel taken as built: only the other kernels' messages are looked at."""
    from workers.backends.cpu import CpuBackend
    from workers.kernels import packed_linear

    monkeypatch.setattr("workers.packed_weight.pack_linear_weights", lambda model: 0)
    monkeypatch.setattr(packed_linear, "available", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CpuBackend().prepare_model(model)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_prefill_kernel_that_failed_to_build_is_named_at_load(monkeypatch):
    """The packed-weight and decode kernels warned at load when their build failed; the prefill
    kernel's reason was kept and never shown, and every prefill silently took torch's attention."""
    from workers.kernels import prefill_attention

    why = "c++ failed to build the prefill attention kernel: some compiler error"
    monkeypatch.setattr(prefill_attention, "_host_build", lambda: why)
    monkeypatch.delenv("CORELAUNCH_PREFILL_ATTENTION", raising=False)
    told = prepare_eager(monkeypatch, model_in(torch.float32))
    assert [m for m in told if "prefill attention" in m and why in m], told


def test_a_prefill_kernel_turned_off_or_never_used_is_not_warned_about_nor_built(monkeypatch):
    """CORELAUNCH_PREFILL_ATTENTION=0 is a choice; a model that does not compute in float32 never
    takes the kernel, so it is not built for it at load."""
    from workers.kernels import prefill_attention

    builds = []
    monkeypatch.setattr(prefill_attention, "_host_build", lambda: builds.append(1) or "it failed")
    monkeypatch.delenv("CORELAUNCH_PREFILL_ATTENTION", raising=False)
    assert not [m for m in prepare_eager(monkeypatch, model_in(torch.bfloat16)) if "prefill" in m]
    assert builds == []
    monkeypatch.setenv("CORELAUNCH_PREFILL_ATTENTION", "0")
    assert not [m for m in prepare_eager(monkeypatch, model_in(torch.float32)) if "prefill" in m]
    assert builds == []


@pytest.mark.parametrize("language", [
    pytest.param("c", marks=pytest.mark.skipif(not HAS_C, reason="no C compiler")),
    pytest.param("c++", marks=pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler"))])
def test_a_compiler_variable_holding_arguments_builds(monkeypatch, tmp_path, language):
    """CXX="ccache g++" or CC="gcc -m64" (a command with arguments, which make splits) turned every
    native kernel off: "No such file or directory: 'gcc -O1'"."""
    variable = "CC" if language == "c" else "CXX"
    monkeypatch.setenv(variable, f"{found_compiler(language)} -O1")
    assert native_build.build_and_load(PROBES[language], tmp_path / "cache").probe() == 7


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
def test_a_blank_compiler_variable_counts_as_unset(monkeypatch, tmp_path):
    """CC="  " was run as the command "  "; blank now falls back to PATH, as empty did."""
    monkeypatch.setenv("CC", "  ")
    assert native_build.build_and_load(PROBES["c"], tmp_path / "cache").probe() == 7


def test_a_compiler_variable_that_cannot_run_is_named(monkeypatch, tmp_path):
    """The message names the variable and the command it held, not a path in the cache."""
    monkeypatch.setenv("CC", "no-such-compiler-here -O1")
    with pytest.raises(NativeUnavailable, match=r"could not run the compiler 'no-such-compiler-here' \(from "
                                                 r"\$CC='no-such-compiler-here -O1'\)"):
        native_build.build_and_load(PROBES["c"], tmp_path / "cache")
    monkeypatch.setenv("CC", "gcc '-O1")
    with pytest.raises(NativeUnavailable, match=r"\$CC=\"gcc '-O1\" is not a command line"):
        native_build.build_and_load(PROBES["c"], tmp_path / "cache")


def refuse_writes_in(monkeypatch, request, folder: Path) -> None:
    """Nothing can be created directly in `folder` afterwards: chmod 0o555, or for root (whom the
    mode does not stop) os.mkdir failing there with EACCES as the mode would make it."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        request.addfinalizer(lambda: folder.chmod(0o700))
        return
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, *, dir_fd=None):
        where = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path if dir_fd is not None else Path(path)
        if where.parent == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir)


FIX = "point CORELAUNCH_CACHE at a directory this user can write"


def test_a_cache_that_cannot_be_created_names_the_fix(monkeypatch, request, tmp_path):
    """A CORELAUNCH_CACHE under a folder this user cannot write (or a read-only mount) said
    "could not create ...: [Errno 13] Permission denied" without the fix."""
    locked = tmp_path / "locked"
    locked.mkdir()
    refuse_writes_in(monkeypatch, request, locked)
    with pytest.raises(NativeUnavailable, match=f"could not create {re.escape(str(locked / 'cache'))}: .*; {FIX}"):
        native_build.build_and_load(PROBES["c"], locked / "cache" / "native-uid0")


def test_a_library_folder_that_cannot_be_written_names_the_fix(monkeypatch, request, tmp_path):
    """The cache's folder exists (this user's, mode 0700) but nothing can be written in it: "could
    not build ... [Errno 30] Read-only file system" without the fix."""
    directory = tmp_path / "cache" / "native-uid0"
    os.close(native_build.trusted_dir(directory))
    refuse_writes_in(monkeypatch, request, directory)
    with pytest.raises(NativeUnavailable, match=f"could not build a probe in {re.escape(str(directory))}: .*; {FIX}"):
        native_build.build_and_load(PROBES["c"], directory)


def test_a_failed_compile_does_not_blame_the_cache(monkeypatch, tmp_path):
    """The fix above is for a cache that cannot be written, not for a compiler that failed."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no false(1) here")
    monkeypatch.setenv("CC", false)
    with pytest.raises(NativeUnavailable) as raised:
        native_build.build_and_load(PROBES["c"], tmp_path / "cache")
    assert "failed to build a probe" in str(raised.value) and "CORELAUNCH_CACHE" not in str(raised.value)


def mounted_noexec(monkeypatch, folder: Path) -> None:
    """`folder` behaves as on a noexec mount: statvfs says so and dlopen of a library in it fails
    with glibc's text."""
    real_statvfs, real_cdll = os.statvfs, native_build.ctypes.CDLL

    def statvfs(path):
        if Path(path) == folder:
            return types.SimpleNamespace(f_flag=os.ST_NOEXEC | os.ST_NOSUID)
        return real_statvfs(path)

    def cdll(name, *args, **kwargs):
        if str(name).startswith("/proc/self/fd/") or Path(name).parent == folder:
            raise OSError(f"{name}: failed to map segment from shared object")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(native_build.ctypes, "CDLL", cdll)


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
def test_a_cache_on_a_noexec_mount_is_named_at_every_start(monkeypatch, tmp_path):
    """dlopen fails with "failed to map segment from shared object", and the next start (the library
    cached) advised deleting it, which never helps: the folder's filesystem is the cause."""
    directory = tmp_path / "cache" / "native-uid0"
    os.close(native_build.trusted_dir(directory))
    mounted_noexec(monkeypatch, directory)
    for start in ("first (compiles)", "next (cached)"):
        with pytest.raises(NativeUnavailable) as raised:
            native_build.build_and_load(PROBES["c"], directory)
        told = str(raised.value)
        assert f"{directory} is on a filesystem mounted noexec" in told, (start, told)
        assert "point CORELAUNCH_CACHE at a directory on a filesystem that allows executing files" in told, start
        assert "delete it" not in told, (start, told)


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
def test_a_cached_library_that_does_not_load_elsewhere_is_still_called_maybe_damaged(monkeypatch, tmp_path):
    """Off a noexec mount the advice for a cached library that does not load stays as it was."""
    directory = tmp_path / "cache" / "native-uid0"
    os.close(native_build.build(PROBES["c"], directory))

    def cdll(name, *args, **kwargs):
        raise OSError(f"{name}: invalid ELF header")

    monkeypatch.setattr(native_build.ctypes, "CDLL", cdll)
    with pytest.raises(NativeUnavailable, match="if .* is damaged, delete it") as raised:
        native_build.build_and_load(PROBES["c"], directory)
    assert "noexec" not in str(raised.value)


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
def test_a_killed_builds_folder_beside_a_built_library_is_swept_by_the_next_load(tmp_path):
    """Dead builds' folders were swept only before a compile: once the library existed nothing
    compiled again, and the folder of a build killed before that stayed in the cache for good."""
    from shardlib.process_alive import process_alive, writer_tag

    cache = tmp_path / "cache"
    os.close(native_build.build(PROBES["c"], cache))  # the library exists: later loads compile nothing
    child = subprocess.Popen(["true"])
    child.wait()
    assert not process_alive(child.pid)
    namespace = native_build._pid_namespace()
    dead = cache / f".build-{writer_tag().rsplit('-', 1)[0]}-{child.pid}-{namespace}n0000aaaa"
    dead.mkdir()
    (dead / "source.c").write_text("int probe(void) { return 7; }\n")
    fd, compiled = native_build._build(PROBES["c"], cache)
    os.close(fd)
    assert not compiled, "the library was there: this load should not have compiled"
    if namespace:  # a folder of this pid namespace's dead writer: swept at once
        assert not dead.exists(), list(cache.iterdir())
    else:  # no namespace to tell by: only an old folder is swept
        old = time.time() - native_build._UNSEEN_WRITER_S - 60
        os.utime(dead, (old, old))
        os.close(native_build.build(PROBES["c"], cache))
        assert not dead.exists(), list(cache.iterdir())
