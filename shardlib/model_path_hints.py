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
