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

import os
from pathlib import Path

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
HEADERS = "precompiled_headers"

_trusted: set[Path] = set()
"""Folders this process has checked (each compile asks)."""
_written: list[str] = []
"""The value this module last wrote into TORCHINDUCTOR_CACHE_DIR: its own, not the user's choice."""


def default_inductor_cache() -> Path:
    from shardlib.demo_model import default_cache_dir

    return default_cache_dir() / f"inductor-uid{os.getuid()}"


def ensure_private_inductor_cache() -> None:
    """TORCHINDUCTOR_CACHE_DIR set to this user's checked folder unless it names one already, and
    inductor's precompiled headers moved into that folder (into the named one where this user's
    cannot be made or trusted). Inductor reads both at each use, so this holds for every later
    compile of the process. NativeUnavailable (a RuntimeError) naming the folder and the fix where
    nothing is named and this user's folder cannot be trusted."""
    from workers.native_build import NativeUnavailable, trusted_dir

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


def named_by_user() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR names a folder other than torch's default and the one this
    module wrote. Inductor's own first lookup writes its default into the variable (a compiler
    import on another thread, or any cache lookup before the first compile, may have made it), so a
    variable holding the default is torch's, not the user's."""
    value = os.environ.get(VARIABLE)
    if not value:
        return False
    # Only now: importing torch._inductor imports dynamo, which looks up (and makes) the cache folder
    # the variable names, else torch's default under $TMPDIR, before this module could name its own.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    value = os.path.abspath(value)
    return value != os.path.abspath(default_cache_dir()) and value not in _written


def _move_precompiled_headers(folder: Path) -> None:
    """torch 2.13 keeps the headers' folder in two module globals of inductor's codecache, read when
    a header is precompiled (after this, before the first compile)."""
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = str(folder)
        codecache._HEADER_LOCK_DIR = str(folder / "locks")
