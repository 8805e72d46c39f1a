"""The manifest.json of a directory corelaunch writes (pre-sharded weights, compiled models).

One writer, and one reader so every such directory fails the same way: a missing file, bad JSON, an
absent field or a field of the wrong type is an error that names the path (and the field) and says
how to write the directory again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "an object", type(None): "null"}


def write_manifest_json(directory: str | Path, manifest: dict[str, Any]) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest_json(directory: str | Path, *, what: str, required: tuple[str, ...],
                       write_hint: str, types: dict[str, type | tuple[type, ...]] | None = None,
                       shown: str | Path | None = None) -> dict[str, Any]:
    """The parsed `directory`/manifest.json, a dict holding every key in `required`.

    what: the kind of directory, for the messages ("a pre-sharded checkpoint").
    write_hint: how to write it again (a command or a function), appended to every error.
    types: the type(s) of each field, checked when the field is present (check_field).
    shown: the directory as the messages name it (default: `directory`), e.g. the link a
        resolved `directory` was reached through.
    """
    shown = Path(directory if shown is None else shown)
    path = shown / MANIFEST
    if not (Path(directory) / MANIFEST).is_file():
        raise FileNotFoundError(f"{shown} is not {what}: it has no {MANIFEST}; {write_hint}")
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); {write_hint}") from None
    absent = [key for key in required if not isinstance(manifest, dict) or key not in manifest]
    if absent:
        raise ValueError(f"{path} lacks {', '.join(absent)}; {write_hint}")
    for key, expected in (types or {}).items():
        if key in manifest:
            check_field(manifest[key], expected, key, path, write_hint)
    return manifest


def check_field(value: Any, expected: type | tuple[type, ...], field: str, path: str | Path, write_hint: str) -> Any:
    """`value` when it is of type `expected` (an int is a float too; a bool is no int), else a
    ValueError naming the manifest `path` and the `field` ("files[2].bytes")."""
    kinds = expected if isinstance(expected, tuple) else (expected,)
    ok = any(type(value) is kind or (kind is float and type(value) is int) for kind in kinds)
    if not ok:
        want = " or ".join(_KINDS.get(kind, kind.__name__) for kind in kinds)
        raise ValueError(f"{path}: field {field!r} must be {want}, found {_shown(value)}; {write_hint}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value)  # it came from JSON
    return text if len(text) <= 60 else text[:57] + "..."
