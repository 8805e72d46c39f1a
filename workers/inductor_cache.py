"""This user's own inductor cache, where TORCHINDUCTOR_CACHE_DIR does not name one, and this user's
own folder for inductor's precompiled C++ headers always.

torch's default is $TMPDIR/torchinductor_<user>: a fixed name in a directory every user of the host
can write. Another user who creates it first owns it, and can replace the generated Python and C++
modules cached there, which the next compile of the same graph imports and runs in every rank (and
plant symlinks where corelaunch's compile locks are opened). Inductor's precompiled headers stay
under that default even when TORCHINDUCTOR_CACHE_DIR is set, and the C++ compiler takes a planted
.gch in place of the header it stands for. So before the first compile a process points both at
$CORELAUNCH_CACHE/inductor-uid<uid>, created mode 0700 and checked as the native libraries'
directory is (workers/native_build.trusted_dir): a real directory of this user's that nobody else
can write. A TORCHINDUCTOR_CACHE_DIR the user names (other than torch's default) is theirs to
trust and is kept; so is a compiled-model directory's cache (workers/compiled.use_cache_dir).
"""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
import threading
from pathlib import Path

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
HEADERS = "precompiled_headers"

_trusted: set[Path] = set()
"""Folders this process has checked (each compile asks)."""
_written: list[str] = []
"""The value this module last wrote into TORCHINDUCTOR_CACHE_DIR: its own, not the user's choice."""
_usable_named: set[str] = set()
"""Named folders this process found usable (each compile asks)."""
_compiled_dir_caches: set[str] = set()
"""Caches of compiled-model directories this process pointed the variable at (use_cache_dir)."""
_failed_imports: list[BaseException] = []
"""What went wrong importing inductor on the prefetch thread (workers/backends/inductor.py): said by
the first compile instead of what a second import of the half-made modules would say."""
_variable_lock = threading.RLock()
"""Held while the variable is read and written: the prefetch thread's choice (keep it, or write
this user's folder) and a compiled-model directory's use_cache_dir on the rank's thread. Unheld,
the prefetch read torch's default, imported inductor (seconds) while the rank pointed the variable
at --out's cache, then wrote its own folder over it: `corelaunch compile` left --out without graphs."""

_UNUSABLE_FIXES = ("name a folder this user can write, or unset it (corelaunch then uses its own folder under "
                  "CORELAUNCH_CACHE)")


def default_inductor_cache() -> Path:
    from shardlib.demo_model import default_cache_dir

    return default_cache_dir() / f"inductor-uid{os.getuid()}"


def ensure_private_inductor_cache() -> None:
    """TORCHINDUCTOR_CACHE_DIR set to this user's checked folder unless it names one already, and
    inductor's precompiled headers moved into that folder (into the named one where this user's
    cannot be made or trusted). Inductor reads both at each use, so this holds for every later
    compile of the process. NativeUnavailable (a RuntimeError) naming the folder and the fix where
    nothing is named and this user's folder cannot be trusted, or where the named folder cannot be
    made or written; RuntimeError where importing inductor failed on the prefetch thread."""
    with _variable_lock:
        _ensure_private_inductor_cache()


def point_at(path: str) -> None:
    """TORCHINDUCTOR_CACHE_DIR set to `path`, a compiled-model directory's cache (made here), which a
    refusal then names as the directory's (mark_compiled_dir_cache); never overwritten by a choice
    the prefetch thread made before it (_variable_lock)."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with _variable_lock:
        mark_compiled_dir_cache(path)
        os.environ[VARIABLE] = path


def _ensure_private_inductor_cache() -> None:
    from workers.native_build import NativeUnavailable, trusted_dir

    if _failed_imports:
        err = _failed_imports[0]
        raise RuntimeError(f"setting up inductor (torch's compiler) failed on the prefetch thread while the shard "
                           f"was read: "
                           f"{type(err).__name__}: {err}") from err
    _check_named_folder()  # before named_by_user() below imports inductor
    named = named_by_user()
    directory: Path | None = default_inductor_cache()
    if directory not in _trusted:
        try:
            os.close(trusted_dir(directory, holding="inductor's compiled graphs"))
            _trusted.add(directory)
        except NativeUnavailable as err:
            if not named:
                raise NativeUnavailable(f"{err} (inductor's precompiled headers go there too; where the cache "
                                        f"cannot be written, set CORELAUNCH_CACHE to a directory of yours that "
                                        f"can, or run without compiling: --no-compile)") from None
            directory = None  # the named cache holds the headers too
    if not named:
        # Before inductor's codecache is imported below: some of its paths are fixed at import.
        os.environ[VARIABLE] = os.path.abspath(directory)
        _written[:] = [os.environ[VARIABLE]]
    _move_precompiled_headers((directory or Path(os.environ[VARIABLE])) / HEADERS)


def unusable_named_folder(value: str) -> str | None:
    """Why the folder `value` (TORCHINDUCTOR_CACHE_DIR) cannot hold inductor's cache, or None: made
    here where missing, as torch would, and a file created and dropped in it (a read-only mount, a
    folder of another user's, a path through a file all fail so)."""
    try:
        os.makedirs(value, exist_ok=True)
        with tempfile.TemporaryFile(dir=value):
            pass
    except OSError as err:
        return str(err)
    return None


def unusable_named_folder_refusal(value: str, why: str,
                                  no_compile: str = "or run without compiling: --no-compile") -> str:
    """The refusal of a named folder, on a rank and (with its own --no-compile advice) on the driver."""
    return f"{VARIABLE} ({value}) cannot hold inductor's compiled graphs: {why}; {_UNUSABLE_FIXES}, {no_compile}"


def mark_compiled_dir_cache(path: str) -> None:
    """`path`, a compiled-model directory's cache, is what TORCHINDUCTOR_CACHE_DIR now names: a refusal
    of it names the directory's fix, not the variable the user never set."""
    _compiled_dir_caches.add(os.path.abspath(path))


def record_failed_import(err: BaseException) -> None:
    """Keep `err`, from importing inductor on the prefetch thread, for the first compile to raise."""
    _failed_imports.append(err)


def _check_named_folder() -> None:
    """NativeUnavailable naming TORCHINDUCTOR_CACHE_DIR where the folder it names cannot be used.
    Importing inductor (dynamo's import makes that folder) failed half-way through on such a folder,
    and every later import of the half-made modules failed with "Artifact of type=precompile already
    registered", naming neither the variable nor the folder. Checked on each rank: the driver checks
    it too (launcher/compile_folders.py), but a joined cluster's ranks have their own environment.
    torch's own default, inherited from a process where inductor had looked it up, is not the
    user's choice: where it cannot be used, this module's own folder replaces it."""
    from workers.native_build import NativeUnavailable

    value = os.environ.get(VARIABLE)
    if not value or os.path.abspath(value) in _written or value in _usable_named:
        return
    why = unusable_named_folder(value)
    if why is None:
        _usable_named.add(value)  # each compile asks: one write to find out is enough
        return
    if os.path.abspath(value) in _compiled_dir_caches:  # the user named the directory, not the variable
        raise NativeUnavailable(f"the compiled-model directory's cache {value} cannot be written ({why}); copy the "
                                f"directory (cp -rL) to a path this user can write and pass that, or run without "
                                f"compiling: --no-compile")
    if os.path.abspath(value) == os.path.abspath(torchs_default_folder()):
        del os.environ[VARIABLE]
        return
    raise NativeUnavailable(unusable_named_folder_refusal(value, why))


def torchs_default_folder() -> str:
    """torch's default cache folder, without importing inductor where it is not loaded yet (that
    import is what fails on an unusable folder): the same rule as its cache_dir_utils."""
    loaded = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if loaded is not None:
        return loaded.default_cache_dir()
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def named_by_user() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR names a folder other than torch's default and the one this
    module wrote. Inductor's own first lookup writes its default into the variable (a compiler
    import on another thread, or any cache lookup before the first compile, may have made it), so a
    variable holding the default is torch's, not the user's."""
    if not os.environ.get(VARIABLE):
        return False
    # Only now: importing torch._inductor imports dynamo, which looks up (and makes) the cache folder
    # the variable names, else torch's default under $TMPDIR, before this module could name its own.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    value = os.path.abspath(os.environ[VARIABLE])  # read again after the import, which takes seconds
    return value != os.path.abspath(default_cache_dir()) and value not in _written


def _move_precompiled_headers(folder: Path) -> None:
    """torch 2.13 keeps the headers' folder in two module globals of inductor's codecache, read when
    a header is precompiled (after this, before the first compile)."""
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = str(folder)
        codecache._HEADER_LOCK_DIR = str(folder / "locks")
