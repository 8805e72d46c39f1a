"""Writing a directory so that it is never seen half written: into a temporary sibling, renamed
into place when complete. Used for pre-sharded checkpoints and compiled-model directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from shardlib.manifest import MANIFEST


def refuse_foreign_dir(out_dir: str | Path, what: str, marker: str = MANIFEST) -> None:
    """FileExistsError when out_dir holds files but no `marker`: it is not a directory of the kind
    being written (`what`, e.g. "a pre-sharded checkpoint"), so replacing it would delete someone's data."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise FileExistsError(f"{out_dir} exists and is not {what} (it has no {marker}); choose a new or empty "
                              f"directory, or remove it")


@contextmanager
def atomic_dir(out_dir: str | Path, what: str, marker: str = MANIFEST) -> Iterator[Path]:
    """Yield an empty temporary sibling of out_dir to write into. When the block ends normally it
    replaces out_dir; when it raises, it is removed and out_dir is left as it was.

    A non-empty out_dir without `marker` is refused first (refuse_foreign_dir). An existing
    directory of this kind is set aside, the new one renamed into place, then the old one removed:
    readers see the old directory or the new one, never a mix.
    """
    out_dir = Path(out_dir)
    refuse_foreign_dir(out_dir, what, marker)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old)  # onto an empty directory: allowed by rename(2)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)  # absent or empty: one atomic rename
