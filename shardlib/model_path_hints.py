"""What to say about a --model path that is not a model directory: a Hugging Face Hub id given where
a local directory is needed (nothing is downloaded), or a file inside the directory."""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""owner/name, as the Hub spells repository ids."""


def hub_id_hint(path: str | Path) -> str:
    """A sentence to append for a missing path that reads as a Hub id; "" otherwise."""
    text = str(path)
    if not _HUB_ID.fullmatch(text) or Path(text).exists():
        return ""
    return (f"; {text!r} looks like a Hugging Face Hub id: corelaunch reads local directories only and downloads "
            f"nothing, so fetch it first (`hf download {text} --local-dir DIR`) and pass --model DIR")


def file_given_for_directory(path: str | Path) -> str:
    """The message for a model path that is a file, naming the directory that holds it."""
    path = Path(path)
    return (f"model path {path} is a file, not a model directory; pass the directory that holds config.json "
            f"and the weights ({path.parent})")
