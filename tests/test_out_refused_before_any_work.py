"""`corelaunch compile --out` and `corelaunch quantize --out` that cannot be written are refused by
the up-front look, before the plan, the weights or the conversion, naming --out and the fix:

- quantize: a file on the way (--out /etc/passwd/q) was found only after converting the whole
  model (14 s for the built-in one), with a worse message;
- compile: a parent that is a link to a path with whitespace passed the whitespace check (it looked
  at the path as given) and failed after the weights were written, naming the hidden version folder;
- both: a name a little under the file system's limit failed at the hidden sibling written beside it
  ("[Errno 36] File name too long: '.NAME.v-...'"), after the work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli import main
from shardlib.atomic_dir import atomic_dir


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command gets past its option checks: compile's plan, quantize's built-in
    model conversion or weights' read."""
    from launcher import launch_plan
    from shardlib import demo_model, quantize_checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the command started its work before refusing --out")

    monkeypatch.setattr(launch_plan, "plan_launch", refuse)
    monkeypatch.setattr(demo_model, "ensure_demo_model", refuse)
    monkeypatch.setattr(quantize_checkpoint, "check_checkpoint", refuse)


def run(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_quantize_refuses_an_out_below_a_file_before_converting(tmp_path, capsys, no_work):
    afile = tmp_path / "afile"
    afile.write_text("")
    code, err = run(capsys, "quantize", "--dtype", "int8", "--out", str(afile / "q"))
    assert code == 2 and err.strip() == (f"corelaunch quantize: could not write --out {afile / 'q'} ({afile} is "
                                         f"a file, not a directory); pass a new path in a directory you can write "
                                         f"to"), err


def test_compile_refuses_an_out_through_a_link_to_a_path_with_whitespace(tmp_path, capsys, monkeypatch, no_work):
    (tmp_path / "a b").mkdir()
    (tmp_path / "lnk").symlink_to(tmp_path / "a b")
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, "compile", "--out", "lnk/c", "--seq-len", "128")
    assert code == 2 and err.strip() == (f"corelaunch compile: --out lnk/c is written through a link to a path with "
                                         f"whitespace, a quote or a backslash ({tmp_path / 'a b' / 'c'}), which the "
                                         f"C++ compiler's command line cannot take; pass a path without them"), err
    assert list((tmp_path / "a b").iterdir()) == []


@pytest.mark.parametrize("command", ["compile", "quantize"])
def test_a_name_too_long_for_the_hidden_sibling_is_refused_up_front(tmp_path, capsys, no_work, command):
    out = tmp_path / ("n" * 240)
    extra = ("--seq-len", "128") if command == "compile" else ("--dtype", "int8")
    code, err = run(capsys, command, "--out", str(out), *extra)
    assert code == 2 and f"--out {out}" in err and ": its name is 240 bytes long" in err, err
    assert "use a name of at most" in err and "Errno" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_longest_name_allowed_is_written_and_one_byte_more_is_refused(tmp_path):
    """The bound is exact: its suggestion ("at most N bytes") works, and the next byte is refused."""
    from shardlib.atomic_dir import sibling_name_too_long

    reason = sibling_name_too_long(tmp_path / ("n" * 250), "lnk")
    allowed = int(reason.rsplit("at most ", 1)[1].split()[0])
    assert sibling_name_too_long(tmp_path / ("n" * allowed), "lnk") is None
    assert sibling_name_too_long(tmp_path / ("n" * (allowed + 1)), "lnk") is not None
    out = tmp_path / ("n" * allowed)
    with atomic_dir(out, "a test directory") as version:
        (version / "manifest.json").write_text("{}")
    assert (out / "manifest.json").is_file()
