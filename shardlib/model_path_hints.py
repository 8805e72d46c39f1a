"""What to say about a --model path that is not a model directory: a Hugging Face Hub id given where
a local directory is needed (nothing is downloaded), or a file inside the directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""owner/name, as the Hub spells repository ids."""


def missing_model_hint(path: str | Path, option: str = "--model") -> str:
    """A sentence to append for a missing model path that reads as a Hub id, or starts with a `~` the
    shell left as it was; "" otherwise. Pass the path as the user typed it (a str): a Path has
    dropped a leading `./`, which says it is no Hub id."""
    text = str(path).rstrip("/")  # a trailing slash, as shells complete folders, names the same id
    if Path(text).exists():
        return ""
    if text.startswith("~"):
        return f"; {unexpanded_home(option, text)}"
    if not _HUB_ID.fullmatch(text) or _local_by_its_look(text):
        return ""
    return (f"; {text!r} looks like a Hugging Face Hub id: corelaunch reads local directories only and downloads "
            f"nothing, so fetch it first (`hf download {text} --local-dir DIR`) and pass {option} DIR")


def _local_by_its_look(text: str) -> bool:
    """A text that reads as a Hub id but whose first folder is here: a missing model in a local
    folder of checkpoints. (A path written from here, above or the root never reads as a Hub id.)"""
    return os.path.isdir(text.split("/", 1)[0])


def file_given_for_directory(path: str | Path) -> str:
    """The message for a model path that is a file, naming the directory that holds it."""
    path = Path(path)
    return (f"model path {path} is a file, not a model directory; pass the directory that holds config.json "
            f"and the weights ({path.parent})")


def unexpanded_home(option: str, path: str | Path) -> str:
    """What to say of a path that starts with `~`: a shell expands it only at the start of a word, so
    `--out=~/x` reaches corelaunch as the text ~/x (quantize wrote a folder named `~` in the working
    directory, which a later `rm -rf ~...` would take for the home folder)."""
    return (f"{option} {path} starts with a `~` that nothing expanded (a shell expands one only at the start of a "
            f"word: `{option} ~/...`, not `{option}=~/...`; Python never does): pass {os.path.expanduser(str(path))}")


def refuse_unexpanded_home(option: str, path: str | Path) -> None:
    """ValueError (unexpanded_home) for a path to be created that starts with a `~` nothing expanded."""
    if str(path).startswith("~") and not Path(path).exists():
        raise ValueError(unexpanded_home(option, path))


def dangling_link(path: str | Path) -> str | None:
    """What to say of a path that is a symlink to nothing, else None. A Hugging Face cache snapshot
    holds only links into the repository's blobs/ folder: copied without it (`cp -r` of the snapshot
    alone), every file is a link to nothing, and was called missing while a listing showed it."""
    path = Path(path)
    if not path.is_symlink() or path.exists():
        return None
    repo = _cached_repo_id(path) or "REPO_ID"
    return (f"{path} is a symlink to {os.readlink(path)}, which does not exist (a Hugging Face cache snapshot "
            f"copied without its blobs): copy the snapshot with `cp -rL SNAPSHOT DIR`, which copies the files the "
            f"links point to, or download the model with `hf download {repo} --local-dir DIR`, and pass DIR")


def dangling_links(directory: Path, names) -> list[str]:
    """dangling_link's message for each of `names` in `directory` that is a symlink to nothing."""
    return [found for found in (dangling_link(directory / name) for name in names) if found is not None]


_CACHED_REPO = re.compile(r"models--(.+)")


def _cached_repo_id(path: Path) -> str | None:
    """owner/name of the Hugging Face cache folder (models--owner--name) that `path` lies in, if any."""
    for part in Path(os.path.abspath(path)).parts:
        found = _CACHED_REPO.fullmatch(part)
        if found:
            return found.group(1).replace("--", "/")
    return None


def cache_repo_hint(path: str | Path) -> str:
    """A sentence to append when `path` is a Hugging Face cache repository folder (models--owner--name,
    which holds refs/, blobs/ and snapshots/) rather than one of its snapshots, the folder that holds
    config.json and the weights; "" otherwise."""
    path = Path(path)
    snapshots = path / "snapshots"
    if not snapshots.is_dir():
        return ""
    main = path / "refs" / "main"
    try:
        revision = main.read_text().strip() if main.is_file() else ""
    except (OSError, UnicodeDecodeError):  # unreadable: the snapshots are listed instead
        revision = ""
    if revision and (snapshots / revision).is_dir():
        return (f"; {path} is a Hugging Face cache folder, not a model directory: pass the snapshot refs/main points "
                f"to, {snapshots / revision}")
    present = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    if not present:
        return f"; {path} is a Hugging Face cache folder with no snapshot in {snapshots}: download the model again"
    return (f"; {path} is a Hugging Face cache folder, not a model directory: pass one of its snapshots "
            f"({', '.join(str(snapshots / name) for name in present[:4])}{' ...' if len(present) > 4 else ''})")
