"""`corelaunch compile --out` under a missing folder the filesystem will not create (/sys, /proc,
a read-only mount): the refusal names --out, the folder that could not be created and the fix, as
a refusal of --out itself does. It printed the bare OSError of that folder (`[Errno 1] Operation not
permitted: '/sys/x'`): the error named an ancestor of --out, which was not taken as --out's."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from launcher.cli import main
from shardlib.atomic_dir import atomic_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.model_factory import build_random_model, save_model

    return save_model(build_random_model(seed=3), tmp_path_factory.mktemp("model"))


def _refuse_mkdir_of(monkeypatch, refused: Path) -> None:
    """Path.mkdir fails on `refused` as a read-only filesystem says so (root passes every access check)."""
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if Path(self) == refused:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)


def test_a_parent_folder_that_cannot_be_created_is_a_failed_write_of_out_dir(tmp_path, monkeypatch):
    from shardlib.atomic_dir import ParentNotCreated, out_dir_failure

    out = tmp_path / "a" / "b" / "out"
    _refuse_mkdir_of(monkeypatch, tmp_path / "a")
    with pytest.raises(ParentNotCreated) as caught, atomic_dir(out, "a test directory"):
        pytest.fail("nothing is written under a parent that could not be created")
    assert caught.value.filename == str(tmp_path / "a") and caught.value.errno == errno.EROFS
    assert out_dir_failure(out, caught.value) == (f"its parent folder {tmp_path / 'a'} could not be created: "
                                                  f"{os.strerror(errno.EROFS)}")
    # the same error for another out_dir, or an input's read that names an ancestor of --out (a model
    # directory holding it), is not taken as this --out's
    assert out_dir_failure(tmp_path / "a" / "other", caught.value) is None
    assert out_dir_failure(out, FileNotFoundError(errno.ENOENT, "No such file", str(tmp_path / "a"))) is None


def test_compile_names_out_when_its_parent_cannot_be_created(tmp_path, monkeypatch, capsys, model_dir):
    out = tmp_path / "ro" / "x" / "y"
    _refuse_mkdir_of(monkeypatch, tmp_path / "ro")
    assert main(["compile", "--tp", "1", "--model", str(model_dir), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"corelaunch compile: could not write --out {out} (its parent folder {tmp_path / 'ro'} "
                           f"could not be created: {os.strerror(errno.EROFS)}); pass a new path in a directory "
                           f"you can write to"), err
    assert not (tmp_path / "ro").exists()


@pytest.mark.skipif(not (Path("/sys/kernel").is_dir() and Path("/proc/self").is_dir()), reason="Linux /sys and /proc")
@pytest.mark.parametrize("out", ["/sys/x/y", "/proc/x/y"])
@pytest.mark.parametrize("command", ["compile", "quantize"])
def test_compile_names_out_under_sys_and_proc(out, command, capsys, model_dir):
    """quantize writes its directory without atomic_dir, and said the same bare error."""
    options = ["--tp", "1"] if command == "compile" else ["--dtype", "int8"]
    assert main([command, *options, "--model", str(model_dir), "--out", out, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"corelaunch {command}: could not write --out {out} (its parent folder "
                          f"{Path(out).parent} could not be created: "), err
    assert err.rstrip().endswith("; pass a new path in a directory you can write to"), err
