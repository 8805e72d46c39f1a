"""Which leftover build folders a native build sweeps (workers/native_build.py _sweep_dead_builds), when
the cache is shared by containers that have the same hostname but their own pid namespaces.

A build folder is named after its writer (host, pid) and swept once that pid is gone. A container
with this hostname but another pid namespace may be compiling into the same cache: its pid is not
visible here, and its live build folder was swept under it (its compile then failed to write its
library). Such a folder, or one whose namespace is not recorded, now waits for an age no build
reaches; a folder written in this pid namespace is still swept as soon as its writer is gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from shardlib.process_alive import process_alive, writer_tag
from workers import native_build
from workers.native_build import LibrarySpec, build



def pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


HERE = pid_namespace()
OLD_S = 2 * 3600.0
"""Older than any build's compiler timeout, younger than the day after which any folder is swept."""


def a_finished_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    assert not process_alive(child.pid)
    return child.pid


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
@pytest.mark.skipif(not HERE, reason="this host does not tell its pid namespace (/proc/self/ns/pid)")
def test_a_dead_pid_of_another_pid_namespace_is_swept_only_once_old(tmp_path):
    cache, host, pid = tmp_path / "cache", writer_tag().rsplit("-", 1)[0], a_finished_pid()
    other = str(int(HERE) + 1)
    this_namespace = f".build-{host}-{pid}-{HERE}n0000aaaa"  # our writer, gone: swept now
    other_namespace = f".build-{host}-{pid}-{other}n0000bbbb"  # may be compiling in another container
    unrecorded = f".build-{host}-{pid}-0000cccc"  # an earlier version's name: no namespace
    other_namespace_old = f".build-{host}-{pid}-{other}n0000dddd"
    unrecorded_old = f".build-{host}-{pid}-0000eeee"
    old = time.time() - OLD_S
    cache.mkdir(mode=0o700)
    for name in (this_namespace, other_namespace, unrecorded, other_namespace_old, unrecorded_old):
        (cache / name).mkdir()
    for name in (other_namespace_old, unrecorded_old):
        os.utime(cache / name, (old, old))
    spec = LibrarySpec(stem="probe", source="int probe(void) { return 7; }", flags=(), what="a probe")
    os.close(build(spec, cache))
    assert sorted(p.name for p in cache.glob(".build-*")) == sorted([other_namespace, unrecorded])
    assert native_build._UNSEEN_WRITER_S < OLD_S


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
@pytest.mark.skipif(not HERE, reason="this host does not tell its pid namespace (/proc/self/ns/pid)")
def test_a_build_names_its_folder_with_its_pid_namespace(tmp_path, monkeypatch):
    """The folder the compiler writes into (seen by a compiler wrapper that logs its arguments)."""
    import re

    cache, log = tmp_path / "cache", tmp_path / "args"
    wrapper = tmp_path / "logging-cc"
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    spec = LibrarySpec(stem="probe", source="int probe(void) { return 8; }", flags=(), what="a probe")
    os.close(build(spec, cache))
    args = log.read_text().split("\n")
    folder = os.path.basename(os.path.dirname(args[args.index("-o") + 1]))
    assert re.fullmatch(rf"\.build-{re.escape(writer_tag())}-{HERE}n[0-9a-f]{{8}}", folder), folder
    assert native_build._written_in_this_pid_namespace(folder[len(".build-"):])
    assert not native_build._written_in_this_pid_namespace(f"{writer_tag()}-0123abcd")  # no namespace
    assert not native_build._written_in_this_pid_namespace(f"{writer_tag()}-{HERE}1n0123abcd")
