"""Where corelaunch's compiles cache their graphs when TORCHINDUCTOR_CACHE_DIR names no directory:
this user's own checked folder, not torch's default under /tmp that any user can take first."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from workers.inductor_cache import default_inductor_cache, ensure_private_inductor_cache
from workers.native_build import NativeUnavailable

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh check in this process, and this process's header folder put back afterwards."""
    import workers.inductor_cache as inductor_cache
    from torch._inductor import codecache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(inductor_cache, "_trusted", set())
    monkeypatch.setattr(inductor_cache, "_written", [])
    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    return tmp_path / "cache" / f"inductor-uid{os.getuid()}"


def test_unset_points_at_this_users_folder_created_0700(own_cache):
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    old = os.umask(0)
    try:
        ensure_private_inductor_cache()
    finally:
        os.umask(old)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(own_cache) == str(default_inductor_cache())
    assert stat.S_IMODE(own_cache.stat().st_mode) == 0o700
    assert cache_dir() == str(own_cache)
    assert codecache._HEADER_DIR == str(own_cache / "precompiled_headers")  # torch's stays under /tmp
    assert codecache._HEADER_LOCK_DIR == str(own_cache / "precompiled_headers" / "locks")


def test_a_directory_the_user_names_is_kept_and_the_headers_still_move(own_cache, tmp_path, monkeypatch):
    from torch._inductor import codecache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    ensure_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert codecache._HEADER_DIR == str(own_cache / "precompiled_headers")


def test_a_folder_others_can_write_is_refused_naming_it(own_cache):
    own_cache.mkdir(parents=True)
    own_cache.chmod(0o777)
    with pytest.raises(NativeUnavailable, match="inductor's compiled graphs: it is writable by group or others"):
        ensure_private_inductor_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_a_named_cache_holds_the_headers_where_this_users_folder_cannot_be_made(own_cache, tmp_path, monkeypatch):
    """With the cache named (TORCHINDUCTOR_CACHE_DIR, or a compiled-model directory's), an unusable
    CORELAUNCH_CACHE failed every compiling launch: the headers go into the named cache instead."""
    from torch._inductor import codecache

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "named"))
    ensure_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "named")
    assert codecache._HEADER_DIR == str(tmp_path / "named" / "precompiled_headers")


def test_a_later_corelaunch_cache_is_followed(own_cache, tmp_path, monkeypatch):
    """The folder written into the variable was then taken for the user's own choice, and a later
    CORELAUNCH_CACHE of the same process was ignored for graphs (its headers moved, its graphs not)."""
    from torch._inductor import codecache

    ensure_private_inductor_cache()
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "second"))
    ensure_private_inductor_cache()
    second = tmp_path / "second" / f"inductor-uid{os.getuid()}"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(second)
    assert codecache._HEADER_DIR == str(second / "precompiled_headers")


def test_a_cache_that_cannot_be_made_is_refused_with_the_fixes(own_cache, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "file" / "cache"))  # under a file: never a folder
    with pytest.raises(NativeUnavailable, match="set CORELAUNCH_CACHE to a directory of yours .* --no-compile"):
        ensure_private_inductor_cache()


def test_a_symlinked_folder_is_refused(own_cache, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    own_cache.parent.mkdir(parents=True)
    own_cache.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NativeUnavailable, match="it is a symlink"):
        ensure_private_inductor_cache()


def test_a_folder_that_cannot_be_created_is_not_called_untrusted(own_cache, monkeypatch):
    """A cache that cannot be written (a read-only mount, the offline set-up's): the folder was never
    made, yet the message said another user could place code there and to remove it."""
    monkeypatch.setenv("CORELAUNCH_CACHE", "/sys")  # exists, and no folder can be made in it, root included
    with pytest.raises(NativeUnavailable) as refused:
        ensure_private_inductor_cache()
    message = str(refused.value)
    assert message.startswith(f"could not create /sys/inductor-uid{os.getuid()} for inductor's compiled graphs: ")
    assert "point CORELAUNCH_CACHE at a directory this user can write" in message and "--no-compile" in message
    assert "Another user could place code there" not in message and "Remove" not in message


PREFETCH_LOOKUP_THEN_COMPILE = """
import torch
from workers.backends.inductor import prefetch_compiler
prefetch_compiler().join()  # as a compiled rank does while its shard loads
from torch._inductor.runtime.cache_dir_utils import cache_dir
cache_dir()  # as a compiler import on another thread may do: writes torch's default into TORCHINDUCTOR_CACHE_DIR
from workers.compiled import _compile
assert _compile(lambda x: x.sin() + 1)(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]
"""


@pytest.mark.slow  # a compile of its own, precompiled headers included (~20 s on 2 cores): one for both cases
def test_a_compile_without_the_variable_caches_in_the_users_folder_whatever_looked_up_torchs_first(tmp_path):
    """torch's own default was $TMPDIR/torchinductor_<user>, its precompiled headers included: here
    TMPDIR is a folder of the test's, which must hold none of it. Two ways torch's default was taken
    before the first compile pointed the variable at this user's folder, both done here before the
    compile: a rank imports inductor on a thread while its shard loads (that import made torch's
    default folder: a file another user placed under that name failed every compiled launch with
    "Artifact of type=precompile already registered"), and a lookup of inductor's cache folder
    wrote torch's default into the variable."""
    import getpass

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(CORELAUNCH_CACHE=str(tmp_path / "cache"), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    planted = tmp_path / "tmp" / f"torchinductor_{getpass.getuser()}"
    planted.write_text("another user's")
    done = subprocess.run([sys.executable, "-c", PREFETCH_LOOKUP_THEN_COMPILE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert planted.read_text() == "another user's"
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [planted.name]  # nothing else, no folder
    own = tmp_path / "cache" / f"inductor-uid{os.getuid()}"
    assert any(own.rglob("*.py")) and any((own / "precompiled_headers").glob("*.gch"))


def test_a_compiled_directorys_cache_set_while_the_prefetch_imports_inductor_is_kept(own_cache, tmp_path,
                                                                                      monkeypatch):
    """The prefetch thread read the variable (torch's default, inherited from a parent that had
    imported inductor), imported inductor for seconds while the rank's thread pointed the variable at
    --out's cache, then wrote this user's folder over it: `corelaunch compile` exited 0 with no
    graphs in --out. Here the import is held until the rank's thread has asked to point it."""
    import threading
    import types

    import workers.inductor_cache as inductor_cache
    from torch._inductor.runtime import cache_dir_utils
    from workers.compiled import use_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir_utils.default_cache_dir())
    asked, importing = threading.Event(), threading.Event()

    class HeldImport(types.ModuleType):
        def __getattr__(self, name):  # `from ... import default_cache_dir` waits here, as a slow import does
            importing.set()
            asked.wait(30)
            return getattr(cache_dir_utils, name)

    monkeypatch.setitem(sys.modules, "torch._inductor.runtime.cache_dir_utils", HeldImport("held"))
    monkeypatch.setattr(inductor_cache, "_compiled_dir_caches", set())
    prefetch = threading.Thread(target=ensure_private_inductor_cache)
    prefetch.start()
    assert importing.wait(30)
    out_cache = tmp_path / "out" / "cache"
    rank = threading.Thread(target=use_cache_dir, args=(str(out_cache),))
    rank.start()
    rank.join(1.0)
    assert rank.is_alive()  # it waits for the prefetch's choice (the lock); without, it had written by now
    asked.set()
    prefetch.join(30)
    rank.join(30)
    assert not prefetch.is_alive() and not rank.is_alive()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(out_cache)
