"""shardlib.atomic_dir: the output path names a complete directory at every instant; leftovers of
killed writers are swept by the next write. Plain files here; tests/test_presharded.py kills real
pre-sharded writers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardlib import atomic_dir as ad
from shardlib.manifest import MANIFEST
from shardlib.process_alive import writer_tag


def write(out, text, fail=False):
    with ad.atomic_dir(out, "a test directory") as tmp:
        (tmp / MANIFEST).write_text("{}")
        (tmp / "data.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "more.txt").write_text(text)
        if fail:
            raise RuntimeError("writer failed")
    return out


def siblings(parent):
    return sorted(p.name for p in parent.iterdir())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_version_is_named_by_the_link_to_it_while_it_is_linked(tmp_path):
    out = write(tmp_path / "d.x", "one")  # a dot in the name: the version's is `.d.x.v-...`
    first = ad.current_version(out)
    assert ad.linking_out_dir(first) == out
    write(out, "two")  # the link moves on; the first version (this process's) stays until swept
    second = ad.current_version(out)
    assert ad.linking_out_dir(second) == out and ad.linking_out_dir(tmp_path / ".d.x.v-host-1-aaaaaaaa") is None
    assert ad.linking_out_dir(out) is None and ad.linking_out_dir(tmp_path / "plain") is None


def test_output_is_a_link_to_a_complete_version_replaced_in_one_rename(tmp_path):
    out = write(tmp_path / "d", "one")
    first = ad.current_version(out)
    assert out.is_symlink() and os.readlink(out) == first.name and (out / "data.txt").read_text() == "one"
    write(out, "two")
    assert (out / "sub" / "more.txt").read_text() == "two"
    assert not first.exists() and siblings(tmp_path) == sorted(["d", ad.current_version(out).name])


def test_a_failing_writer_leaves_the_old_version_and_no_leftover(tmp_path):
    out = write(tmp_path / "d", "one")
    before = siblings(tmp_path)
    with pytest.raises(RuntimeError):
        write(out, "two", fail=True)
    assert (out / "data.txt").read_text() == "one" and siblings(tmp_path) == before


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
def test_a_plain_directory_of_the_earlier_scheme_is_replaced_by_the_link(tmp_path, monkeypatch, exchange):
    out = tmp_path / "d"
    out.mkdir()
    (out / MANIFEST).write_text("{}")
    (out / "data.txt").write_text("old")
    if not exchange:
        monkeypatch.setattr(ad, "_exchange", lambda a, b: False)
    write(out, "new")
    assert out.is_symlink() and (out / "data.txt").read_text() == "new"
    assert siblings(tmp_path) == sorted(["d", ad.current_version(out).name])


def test_an_empty_directory_is_replaced_and_a_foreign_one_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert (write(tmp_path / "empty", "x") / "data.txt").read_text() == "x"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="mine"):
        write(tmp_path / "mine", "x")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_users_own_link_is_refused_naming_its_target_and_the_writers_own_is_rewritten(tmp_path):
    """A review: `--out ~/compiled`, a link the user made to a larger disk, was replaced by a link of
    the writer's, the files written beside it on the home disk and the disk it named left as it was."""
    (tmp_path / "bigdisk").mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "out").symlink_to(tmp_path / "bigdisk")
    with pytest.raises(FileExistsError, match=f"out is a link to {tmp_path / 'bigdisk'} that no writer of .* made: "
                                              f"writing would replace the link"):
        write(tmp_path / "home" / "out", "x")
    assert (tmp_path / "home" / "out").resolve() == tmp_path / "bigdisk" and not any((tmp_path / "bigdisk").iterdir())
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["out"]  # nothing written beside it
    write(tmp_path / "home" / "ours", "x")  # a link of the writer's own: written again
    assert (write(tmp_path / "home" / "ours", "y") / "data.txt").read_text() == "y"


def test_stale_leftovers_are_swept_by_the_next_write_and_live_ones_kept(tmp_path):
    out = write(tmp_path / "d", "one")
    host = writer_tag().rsplit("-", 1)[0]
    dead = tmp_path / f".d.v-{host}-{dead_pid()}-0000aaaa"  # a killed writer on this host
    alive = tmp_path / f".d.v-{host}-{os.getppid()}-0000bbbb"  # a writer still running here
    remote = tmp_path / ".d.v-otherhost-1-0000cccc"  # another host's writer: only its age tells
    remote_old = tmp_path / ".d.v-otherhost-2-0000dddd"
    legacy_new, legacy_old = tmp_path / ".d.tmp-abcdef12", tmp_path / ".d.old-abcdef34"
    stale_link = tmp_path / f".d.lnk-{host}-{dead_pid()}-0000eeee"
    unrelated = tmp_path / ".e.v-x-1-0000ffff"
    for folder in (dead, alive, remote, remote_old, legacy_new, legacy_old, unrelated):
        folder.mkdir()
        (folder / "part").write_text("half written")
    stale_link.symlink_to(dead.name)
    day_ago = time.time() - ad.STALE_AFTER_S - 60
    for folder in (remote_old, legacy_old):
        os.utime(folder, (day_ago, day_ago))

    write(out, "two")
    assert (out / "data.txt").read_text() == "two"
    assert siblings(tmp_path) == sorted(["d", ad.current_version(out).name, alive.name, remote.name,
                                         legacy_new.name, unrelated.name])


def test_the_sweep_leaves_names_it_never_writes(tmp_path):
    """A user's own .d.v-important or .d.old-2024-backup beside the output was removed by the next
    write (the first at once: an owner it could not parse counted as gone)."""
    out = write(tmp_path / "d", "one")
    theirs = [tmp_path / ".d.v-important", tmp_path / ".d.old-2024-backup", tmp_path / ".d.lnk-notes"]
    day_ago = time.time() - ad.STALE_AFTER_S - 60
    for folder in theirs:
        folder.mkdir()
        (folder / "keep").write_text("mine")
        os.utime(folder, (day_ago, day_ago))
    write(out, "two")
    assert all((folder / "keep").read_text() == "mine" for folder in theirs)


def test_a_directory_with_a_manifest_of_another_kind_is_refused(tmp_path):
    """A manifest.json alone is a file any project may have: the kind's own reader decides."""
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "my app"}')

    def read_kind(path):
        raise ValueError(f"{path}/manifest.json lacks buckets; write it with ...")

    with pytest.raises(FileExistsError, match=r"is not a thing \(its manifest.json is not one: .*lacks buckets\)"):
        ad.refuse_foreign_dir(webapp, "a thing", read_kind=read_kind)
    ad.refuse_foreign_dir(webapp, "a thing", read_kind=lambda path: {})  # its own kind: replaced


def test_a_version_a_launch_holds_outlives_the_next_writes_until_it_is_released(tmp_path):
    """A compile into the --out a running server used deleted the server's version right after the
    swap: its next graph was built from nothing into a folder inductor made again, and its next
    restart failed for good on the missing files."""
    out = write(tmp_path / "d", "one")
    first = ad.current_version(out)
    hold = ad.hold_version(first)  # what a launch from the directory takes at start
    assert hold is not None and ad.in_use(first)
    try:
        write(out, "two")
        assert (first / "data.txt").read_text() == "one" and (out / "data.txt").read_text() == "two"
        later = time.time() + ad.STALE_AFTER_S + 1  # old enough for any sweep
        assert first not in ad.sweep_stale(out, now=later) and first.exists()
    finally:
        os.close(hold)  # the launch shut down
    assert not ad.in_use(first)
    assert first in ad.sweep_stale(out, now=later) and not first.exists()
    write(out, "three")  # and a version nobody holds goes at the swap, as before
    assert siblings(tmp_path) == sorted(["d", ad.current_version(out).name])


def test_a_plain_directory_a_launch_holds_is_not_replaced_under_it(tmp_path):
    """A `cp -rL` copy is a plain directory a launch reads by its path: a compile into it exchanged
    and deleted it under the launch holding it (the hold kept only link-named versions)."""
    plain = tmp_path / "copy"
    plain.mkdir()
    (plain / MANIFEST).write_text("{}")
    hold = ad.hold_version(plain)
    try:
        with pytest.raises(FileExistsError, match=r"is in use by a running launch, and is a plain directory .* write to another path"):
            write(plain, "new")
        assert (plain / MANIFEST).is_file() and not plain.is_symlink()
    finally:
        os.close(hold)
    write(plain, "new")  # once released, replaced as before
    assert plain.is_symlink() and (plain / "data.txt").read_text() == "new"


@pytest.mark.parametrize("failure", [KeyboardInterrupt, SystemExit])
def test_a_failed_removal_of_the_previous_version_keeps_the_committed_write(tmp_path, monkeypatch, failure):
    """Ctrl-C (or SIGTERM's SystemExit) while the previous version was removed after the swap made
    atomic_dir's clean-up delete the new version too: `out` dangled and the previous one was half
    deleted. (The removal ignores its own errors: an interrupt is what reaches here.)"""
    out = write(tmp_path / "d", "one")
    previous = ad.current_version(out)
    real_rmtree = ad.shutil.rmtree

    def interrupted_rmtree(path, *args, **kwargs):
        if os.path.basename(path) == previous.name:
            (previous / "data.txt").unlink()  # part of it was deleted when the interrupt came
            raise failure("interrupted")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ad.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(failure):  # the interrupt still ends the caller, the write committed
        write(out, "two")
    assert (out / "data.txt").read_text() == "two" and (out / "sub" / "more.txt").read_text() == "two"
    second = ad.current_version(out)
    assert siblings(tmp_path) == sorted(["d", previous.name, second.name])  # the half-deleted one is left...

    monkeypatch.setattr(ad.shutil, "rmtree", real_rmtree)
    third = ad.current_version(write(out, "three"))  # ...until the next write (same process) sweeps it
    assert (out / "data.txt").read_text() == "three" and siblings(tmp_path) == sorted(["d", third.name])


def test_a_version_this_process_is_still_writing_is_not_swept(tmp_path):
    """The sweep removes this process's unlinked versions, but never one a write in progress fills."""
    out = write(tmp_path / "d", "one")
    with ad.atomic_dir(out, "a test directory") as filling:
        (filling / MANIFEST).write_text("{}")
        assert ad.sweep_stale(out) == [] and filling.is_dir()
    assert ad.current_version(out) == filling
