"""The folders a cpu rank's first compile uses are checked before Ray starts (launcher/compile_folders.py).

A TMPDIR or CORELAUNCH_CACHE with a space broke every rank's first compile with a raw g++ error, and
a CORELAUNCH_CACHE that cannot be made failed every rank's load: each after Ray had started, the
group restarted three times and was given up (`serve` answered /health, then 503 to every request).
A TMPDIR with a non-ASCII character stopped ray.init with a bare 'ascii' codec error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launcher.api import Launcher

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def private_ray_ahead(monkeypatch, ray_tripwire):
    """As in a fresh process whose launch would start a private Ray of this host (which hands the
    ranks this environment), with Ray itself out of reach."""
    from launcher.cluster import ray_cluster

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return monkeypatch


def test_a_tmpdir_with_a_space_is_refused_before_ray_for_a_compiled_launch(private_ray_ahead, tmp_path):
    spaced = tmp_path / "t mp"
    spaced.mkdir()
    private_ray_ahead.setattr(tempfile, "tempdir", str(spaced))
    with pytest.raises(ValueError, match=rf"^TMPDIR \({spaced}\) holds whitespace, .* point TMPDIR at a path "
                                         r"without them, or run without compiling: --no-compile$"):
        Launcher(tp=1, progress=False).prepare()
    Launcher(tp=1, compile=False, progress=False).prepare()  # eager ranks compile nothing


def test_a_corelaunch_cache_with_a_space_is_refused_before_ray(private_ray_ahead, tmp_path):
    spaced = tmp_path / "ca che"
    private_ray_ahead.setenv("CORELAUNCH_CACHE", str(spaced))
    with pytest.raises(ValueError, match=rf"^CORELAUNCH_CACHE: the ranks keep inductor's compiled graphs in "
                                         rf"{spaced}/inductor-uid{os.getuid()}, a path with whitespace.* set "
                                         r"CORELAUNCH_CACHE to a directory whose path has none"):
        Launcher(tp=1, progress=False).prepare()
    private_ray_ahead.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind uctor"))
    with pytest.raises(ValueError, match=r"^TORCHINDUCTOR_CACHE_DIR \(.*ind uctor\) holds whitespace"):
        Launcher(tp=1, progress=False).prepare()


def test_a_corelaunch_cache_that_cannot_be_made_is_refused_before_ray_with_the_model_given(private_ray_ahead, tmp_path):
    """With --model DIR nothing else reads CORELAUNCH_CACHE on the driver: each rank failed its load."""
    from tests.model_factory import build_random_model, save_model

    model = str(save_model(build_random_model(seed=3), tmp_path / "model"))
    a_file = tmp_path / "afile"
    a_file.write_text("")
    private_ray_ahead.setenv("CORELAUNCH_CACHE", str(a_file))
    with pytest.raises(ValueError, match=rf"^CORELAUNCH_CACHE \({a_file}\) cannot hold inductor's compiled graphs: "
                                         rf"could not create {a_file}: .*set CORELAUNCH_CACHE to a directory this user "
                                         r"can write, or run without compiling: --no-compile$"):
        Launcher(tp=1, progress=False, model=model).prepare()
    Launcher(tp=1, compile=False, progress=False, model=model).prepare()
    private_ray_ahead.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a joined cluster's nodes have their own environment
    Launcher(tp=1, progress=False, model=model).prepare()


def test_a_tmpdir_of_other_than_ascii_is_named_with_the_fix():
    """Ray's core worker encodes its session paths as ASCII: a real `generate`, whose ray.init fails."""
    accented = Path(tempfile.mkdtemp(prefix="clé-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        done = subprocess.run([sys.executable, "-m", "launcher", "generate", "--no-compile", "--quiet",
                               "--max-new-tokens", "1", "hi"], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "TMPDIR": str(accented), "RAY_ADDRESS": ""})
    finally:
        shutil.rmtree(accented, ignore_errors=True)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"corelaunch generate: the private Ray cluster did not start: 'ascii' codec can't encode "
                         f"character '\\xe9' in position 7: ordinal not in range(128); Ray's "
                         f"temporary folder (TMPDIR, or RAY_TMPDIR: {accented}) must be a path of ASCII characters: "
                         f"point it at one, such as /tmp"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_corelaunch_compile_is_not_refused_over_the_cache_its_ranks_do_not_use(private_ray_ahead, tmp_path):
    """`corelaunch compile` ranks compile into --out's own cache: an untrusted CORELAUNCH_CACHE folder
    was refused with the advice --no-compile, a flag compile does not have."""
    from launcher.api import LaunchConfig
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress
    from tests.model_factory import build_random_model, save_model

    shared = tmp_path / "cache" / f"inductor-uid{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    private_ray_ahead.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    # A model of the test's own: without one, planning converted the built-in model into this
    # empty cache first (half a minute), which has nothing to do with the compile cache's check.
    model = str(save_model(build_random_model(seed=3), tmp_path / "model"))
    config = LaunchConfig(tp=1, progress=False, compile=True, model=model)
    with pytest.raises(ValueError, match=r"cannot hold inductor's compiled graphs: refusing to use"):
        plan_launch(config, Progress(False))  # a launch's ranks would use it
    plan_launch(config, Progress(False), into_out=True)
    spaced = tmp_path / "t mp"
    spaced.mkdir()
    private_ray_ahead.setattr(tempfile, "tempdir", str(spaced))
    with pytest.raises(ValueError) as refused:
        plan_launch(config, Progress(False), into_out=True)
    assert str(refused.value).endswith("point TMPDIR at a path without them")  # no --no-compile to offer


def test_an_unusable_cache_offers_no_bare_no_compile_to_the_built_in_model_not_yet_converted(private_ray_ahead, tmp_path):
    """The built-in model is converted into the same cache: --no-compile alone met a second refusal."""
    a_file = tmp_path / "afile"
    a_file.write_text("")
    private_ray_ahead.setenv("CORELAUNCH_CACHE", str(a_file))
    with pytest.raises(ValueError) as refused:
        Launcher(tp=1, progress=False).prepare()
    message = str(refused.value)
    assert message.startswith(f"CORELAUNCH_CACHE ({a_file}) cannot hold inductor's compiled graphs: ")
    assert message.endswith("or run without compiling a model of your own: --no-compile --model DIR (the built-in "
                            "one is converted into this cache too)")


def test_an_unset_corelaunch_cache_is_not_named_as_set(private_ray_ahead, tmp_path):
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "corelaunch").write_text("")  # the default cache folder is a file
    private_ray_ahead.setenv("HOME", str(home))
    private_ray_ahead.delenv("CORELAUNCH_CACHE", raising=False)
    with pytest.raises(ValueError, match=rf"^the corelaunch cache \(CORELAUNCH_CACHE unset: {home}/\.cache/corelaunch\) "
                                         r"cannot hold inductor's compiled graphs: .*set CORELAUNCH_CACHE to a "
                                         r"directory this user can write"):
        Launcher(tp=1, progress=False).prepare()
