"""The manifest.json of a directory corelaunch writes (pre-sharded weights, compiled models).

One writer, and one reader so every such directory fails the same way: a missing file, bad JSON or
an absent field is an error that names the path and says how to write the directory again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def write_manifest_json(directory: str | Path, manifest: dict[str, Any]) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest_json(directory: str | Path, *, what: str, required: tuple[str, ...],
                       write_hint: str) -> dict[str, Any]:
    """The parsed `directory`/manifest.json, a dict holding every key in `required`.

    what: the kind of directory, for the messages ("a pre-sharded checkpoint").
    write_hint: how to write it again (a command or a function), appended to every error.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not {what}: it has no {MANIFEST}; {write_hint}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); {write_hint}") from None
    absent = [key for key in required if not isinstance(manifest, dict) or key not in manifest]
    if absent:
        raise ValueError(f"{path} lacks {', '.join(absent)}; {write_hint}")
    return manifest
