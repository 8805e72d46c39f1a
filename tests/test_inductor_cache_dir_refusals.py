"""A TORCHINDUCTOR_CACHE_DIR that names a folder which cannot be made or written (under a file, a
read-only mount, a typo) is refused naming the variable, its value and the fixes.

It failed every compiled `corelaunch generate` with rc 3: "rank 0 ... failed to load its shard:
Artifact of type=precompile already registered in mega-cache artifact factory". The rank's prefetch
thread imported inductor, whose dynamo import makes the named folder and failed half-way; that
failure was dropped, and the first compile imported the half-made modules again. Now the driver
refuses it before Ray starts (launcher/compile_folders.py), and each rank before importing inductor
(workers/inductor_cache.py: a joined cluster's ranks have their own environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def under_a_file(tmp_path) -> Path:
    """A folder that can never be made: its parent is a file."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path / "config.json" / "inductor"


@pytest.fixture
def private_ray_ahead(monkeypatch, ray_tripwire):
    """As in a fresh process whose launch would start a private Ray of this host, Ray out of reach."""
    import ray

    from launcher.cluster import ray_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return monkeypatch


def test_the_driver_refuses_a_named_cache_that_cannot_be_made_before_ray(private_ray_ahead, under_a_file, tmp_path,
                                                                         capsys):
    from launcher.api import Launcher
    from launcher.cli import main
    from tests.model_factory import build_random_model, save_model

    model = str(save_model(build_random_model(seed=3), tmp_path / "model"))
    private_ray_ahead.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    private_ray_ahead.setenv("TORCHINDUCTOR_CACHE_DIR", str(under_a_file))
    with pytest.raises(ValueError, match=rf"^TORCHINDUCTOR_CACHE_DIR \({under_a_file}\) cannot hold inductor's "
                                         rf"compiled graphs: \[Errno 20\] Not a directory: .*; name a folder this "
                                         r"user can write, or unset it \(corelaunch then uses its own folder under "
                                         r"CORELAUNCH_CACHE\), or run without compiling: --no-compile$"):
        Launcher(tp=1, progress=False, model=model).prepare()
    assert main(["generate", "--model", model, "--max-new-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"TORCHINDUCTOR_CACHE_DIR ({under_a_file}) cannot hold" in err and "--no-compile" in err, err
    Launcher(tp=1, compile=False, progress=False, model=model).prepare()  # eager ranks use no cache


def test_the_driver_makes_a_named_cache_that_is_missing(private_ray_ahead, tmp_path):
    """A folder not there yet is no fault: torch makes it too."""
    from launcher.api import Launcher
    from tests.model_factory import build_random_model, save_model

    model = str(save_model(build_random_model(seed=3), tmp_path / "model"))
    private_ray_ahead.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    private_ray_ahead.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "new" / "inductor"))
    Launcher(tp=1, progress=False, model=model).prepare()
    assert (tmp_path / "new" / "inductor").is_dir()


@pytest.fixture
def fresh_check(tmp_path, monkeypatch):
    """ensure_private_inductor_cache as on a fresh rank, this process's header folder put back after."""
    import workers.inductor_cache as inductor_cache
    from torch._inductor import codecache

    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(inductor_cache, "_trusted", set())
    monkeypatch.setattr(inductor_cache, "_written", [])
    monkeypatch.setattr(inductor_cache, "_failed_imports", [], raising=False)  # older code: none
    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    return monkeypatch


def test_a_rank_refuses_a_named_cache_that_cannot_be_made(fresh_check, under_a_file):
    from workers.inductor_cache import ensure_private_inductor_cache
    from workers.native_build import NativeUnavailable

    fresh_check.setenv("TORCHINDUCTOR_CACHE_DIR", str(under_a_file))
    with pytest.raises(NativeUnavailable, match=rf"^TORCHINDUCTOR_CACHE_DIR \({under_a_file}\) cannot hold "
                                                r"inductor's compiled graphs: .*Not a directory.*unset it .*"
                                                r"--no-compile$"):
        ensure_private_inductor_cache()


def test_a_rank_replaces_torchs_own_default_where_it_cannot_be_made(fresh_check, tmp_path):
    """torch's default, inherited from a process where inductor had looked it up, is not the user's
    choice: a file another user placed under its name is no reason to refuse."""
    import getpass
    import tempfile

    from workers.inductor_cache import default_inductor_cache, ensure_private_inductor_cache

    fresh_check.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"torchinductor_{getpass.getuser()}"
    planted.write_text("another user's")
    fresh_check.setenv("TORCHINDUCTOR_CACHE_DIR", str(planted))
    ensure_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(default_inductor_cache())



def test_a_compiled_directorys_cache_that_cannot_be_written_names_the_directorys_fix(fresh_check, under_a_file):
    """A --compiled directory's cache (use_cache_dir points the variable at it) on a read-only copy was
    refused as a TORCHINDUCTOR_CACHE_DIR to unset, a variable the user never set."""
    import workers.inductor_cache as inductor_cache
    from workers.native_build import NativeUnavailable

    fresh_check.setattr(inductor_cache, "_compiled_dir_caches", set(), raising=False)
    fresh_check.setenv("TORCHINDUCTOR_CACHE_DIR", str(under_a_file))
    inductor_cache.mark_compiled_dir_cache(str(under_a_file))
    with pytest.raises(NativeUnavailable) as refused:
        inductor_cache.ensure_private_inductor_cache()
    assert str(refused.value).startswith(f"the compiled-model directory's cache {under_a_file} cannot be written ("), \
        str(refused.value)
    assert "copy the directory (cp -rL) to a path this user can write" in str(refused.value)


DRIVER_CHECK = """
import sys, types
from launcher.cluster import ray_cluster
from launcher.compile_folders import check_compile_folders
ray_cluster.private_cluster = lambda address: True  # as a launch that starts a private Ray of this host
check_compile_folders(types.SimpleNamespace(compile=True, ray_address=None, compiled_dir=None), "cpu")
print("inductor loaded:", "torch._inductor" in sys.modules)
"""


def test_the_driver_leaves_torchs_own_default_to_the_ranks(tmp_path):
    """torch's default folder, inherited from a parent that had used inductor, was refused on the
    driver ("unset it") where each rank replaces it with its own folder. A fresh process, as the
    CLI's: inductor not loaded, so the driver cannot ask it."""
    import getpass

    planted = tmp_path / f"torchinductor_{getpass.getuser()}"
    planted.write_text("another user's")
    env = dict(os.environ, TMPDIR=str(tmp_path), CORELAUNCH_CACHE=str(tmp_path / "cache"),
               TORCHINDUCTOR_CACHE_DIR=str(planted))
    done = subprocess.run([sys.executable, "-c", DRIVER_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "inductor loaded: False", done.stdout


PREFETCH_THEN_COMPILE = """
import torch
from workers.backends.inductor import prefetch_compiler
prefetch_compiler().join()  # as a compiled rank does while its shard loads
from workers.compiled import _compile
_compile(lambda x: x + 1)
"""


def test_a_rank_names_the_variable_not_a_half_imported_compiler(tmp_path, under_a_file):
    """A fresh process, as a rank: its prefetch thread used to import inductor half-way, and the
    first compile then failed with "Artifact of type=precompile already registered"."""
    env = dict(os.environ, CORELAUNCH_CACHE=str(tmp_path / "cache"), TORCHINDUCTOR_CACHE_DIR=str(under_a_file))
    done = subprocess.run([sys.executable, "-c", PREFETCH_THEN_COMPILE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode != 0, done.stderr[-3000:]
    assert last.startswith(f"workers.native_build.NativeUnavailable: TORCHINDUCTOR_CACHE_DIR ({under_a_file}) "
                           f"cannot hold inductor's compiled graphs"), done.stderr[-3000:]
    assert "already registered" not in done.stderr


FAILED_PREFETCH_THEN_COMPILE = """
import sys
import torch
sys.modules["torch._inductor.compile_fx"] = None  # the prefetch thread's import of the compiler fails
from workers.backends.inductor import prefetch_compiler
prefetch_compiler().join()
del sys.modules["torch._inductor.compile_fx"]
from workers.compiled import _compile
_compile(lambda x: x + 1)
"""


def test_the_first_compile_raises_what_failed_on_the_prefetch_thread(tmp_path):
    """Whatever else fails importing inductor on the prefetch thread is said by the first compile,
    not dropped for a second import of half-made modules to fail over."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["CORELAUNCH_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", FAILED_PREFETCH_THEN_COMPILE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stderr[-3000:]
    assert ("RuntimeError: setting up inductor (torch's compiler) failed on the prefetch thread while the shard was "
            "read: "
            "ModuleNotFoundError: import of torch._inductor.compile_fx halted") in done.stderr, done.stderr[-3000:]
