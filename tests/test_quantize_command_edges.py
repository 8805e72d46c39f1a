"""`corelaunch quantize` at its edges: its progress where stderr is a pipe or a log file, and an
--out inside the --model directory.

The progress runs the command as a subprocess, its stderr a pipe or a terminal (a pty), on a
random checkpoint of many layers: as many tensors as that gives the demo model's 272 their own
line each, in seconds rather than the half minute the demo model takes.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main
from shardlib.demo_model import ensure_demo_model
from tests.model_factory import save_random_model

REPO = Path(__file__).resolve().parents[1]
NUM_LAYERS = 12
NUM_TENSORS = 9 * NUM_LAYERS + 3  # per layer 7 projections and 2 norms; the embedding, final norm, LM head


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("quantize_edges") / "model", num_layers=NUM_LAYERS, seed=5)


def quantize(model: Path, out: Path, stderr) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", "quantize", "--model", str(model), "--dtype", "int8",
                             "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)


def read_all(fd: int) -> bytes:
    """Everything written to a pty's other end until the process closes it (Linux: EIO at the end)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def test_progress_is_rewritten_in_place_on_a_terminal_and_plain_lines_elsewhere(model, tmp_path):
    """To a pipe or log file the \\r progress was one line of a fragment per tensor (272 for the
    demo model), which logs and CI show as one line or as hundreds."""
    proc = quantize(model, tmp_path / "piped", subprocess.PIPE)
    _, err = proc.communicate(timeout=240)
    text = err.decode()
    assert proc.returncode == 0, text
    lines = text.splitlines()
    assert "\r" not in text and len(lines) < 20, text
    assert lines[0] == f"quantize: 1/{NUM_TENSORS} tensors", text
    assert lines[-2] == f"quantize: {NUM_TENSORS}/{NUM_TENSORS} tensors", text
    assert lines[-1].startswith(f"quantize: wrote {tmp_path / 'piped'} in "), text

    leader, follower = pty.openpty()  # a terminal keeps the one line rewritten in place
    try:
        proc = quantize(model, tmp_path / "terminal", follower)
        os.close(follower)
        shown = read_all(leader).decode()
    finally:
        os.close(leader)
    assert proc.wait(timeout=240) == 0, shown
    assert shown.count("\rquantize: ") == NUM_TENSORS, shown
    assert f"\rquantize: {NUM_TENSORS}/{NUM_TENSORS} tensors\r\nquantize: wrote " in shown, shown  # onlcr: \n is \r\n


def test_an_out_inside_the_model_directory_is_refused_before_anything_is_written(model, tmp_path, capsys):
    """It was written into the model's folder: the built-in model's cache folder is replaced whole
    when it is converted again, so the quantized copy was lost without a word."""
    linked = tmp_path / "link"
    linked.symlink_to(model)
    before = sorted(p.name for p in model.iterdir())
    for out in (model / "q8", model / "tokenizer" / ".." / "q8", linked / "q8", model / "nested" / "q8"):
        capsys.readouterr()
        assert main(["quantize", "--model", str(model), "--dtype", "int8", "--out", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert f"--out {out} is inside the --model directory {model}" in err, err
        assert "pass a path outside the model directory" in err, err
    assert main(["quantize", "--model", str(model), "--dtype", "int8", "--out", str(model)]) == 2
    assert f"--out {model} is the --model directory {model}" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == before  # no copy, no partial folder beside it

    demo = ensure_demo_model()  # the case found: the built-in model's own cache folder
    demo_files = sorted(p.name for p in demo.iterdir())
    assert main(["quantize", "--dtype", "int8", "--out", str(demo / "q8"), "--quiet"]) == 2
    assert f"is inside the --model directory {demo}" in capsys.readouterr().err
    assert sorted(p.name for p in demo.iterdir()) == demo_files


def test_a_missing_model_is_named_before_an_out_inside_it(tmp_path, capsys):
    """A mistyped --model with --out beside it was told its --out lay inside the model's folder."""
    missing = tmp_path / "typo"
    assert main(["quantize", "--model", str(missing), "--dtype", "int8", "--out", str(missing / "q8"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--model {missing} does not exist" in err and "inside" not in err, err


def test_an_out_inside_the_built_in_models_folder_is_refused_before_it_is_converted(tmp_path, capsys, monkeypatch):
    """Without --model, the refusal came once the built-in model had been converted (about 30 s
    the first time): a cache of no model shows nothing was converted first."""
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cache" / "smollm2-135m-instruct" / "q8"
    assert main(["quantize", "--dtype", "int8", "--out", str(out), "--quiet"]) == 2
    assert "is inside the --model directory" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_an_unknown_dtype_is_named_first_without_model_too(tmp_path, capsys, monkeypatch):
    """With the built-in model, an --out inside its folder was named before an unknown --dtype, which
    --model named first."""
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cache" / "smollm2-135m-instruct" / "q8"
    assert main(["quantize", "--dtype", "bogus", "--out", str(out), "--quiet"]) == 2
    assert "unknown quantization dtype 'bogus'" in capsys.readouterr().err
