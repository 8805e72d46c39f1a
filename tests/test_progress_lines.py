"""launcher.progress off a terminal: each note and step line is one line of the log, however long
(rich wrapped them at 80 columns, splitting a quoted path or command in two)."""

from __future__ import annotations

from launcher.progress import Progress


def test_a_long_note_into_a_log_is_one_line(capfd):
    path = "/srv/models/" + "a-rather-long-folder-name/" * 7 + "config.json"
    note = f"corelaunch: read {path} and run `corelaunch plan --model {path}` to size it"
    assert len(note) > 200
    Progress().note(note)
    assert capfd.readouterr().err == note + "\n"


def test_a_long_step_line_into_a_log_is_one_line(capfd):
    what = "starting 1 replica(s) of 1 cpu worker(s), 2 thread(s) each: joining their groups and loading each shard"
    progress = Progress()
    with progress.step(what):
        pass
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and what in err and err.startswith("✓ ")


def test_colon_words_in_a_note_or_step_stay_as_written(capfd):
    """rich's emoji codes: a compiler's "k.c:100:5" read "k.c💯5", a path's ":up:" an arrow."""
    note = "corelaunch: rank 1 failed: /tmp/k.c:100:5: error :warning:"
    progress = Progress()
    progress.note(note)
    with progress.step("reading /models/a:up:b"):
        pass
    err = capfd.readouterr().err
    assert err.startswith(note + "\n") and "reading /models/a:up:b" in err, err
