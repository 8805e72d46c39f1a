"""The end-of-sequence ids a checkpoint's generation_config.json adds to config.json's.

Chat models often name their end-of-turn token only there (Llama 3 Instruct: config.json's
eos_token_id is <|end_of_text|>, generation_config.json adds <|eot_id|>); transformers' generate
stops at those ids, so a server that read config.json alone would run past the end of a turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlib.config_fields import token_ids

FILE_NAME = "generation_config.json"


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an integer, a list of them, or null), () when the
    directory has no such file; ValueError naming the file for one that cannot be read."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return ()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err}); fix or remove it") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(raw).__name__}; fix or remove it")
    value = raw.get("eos_token_id")
    try:
        return token_ids("eos_token_id", value)
    except ValueError:  # its message names config.json
        raise ValueError(f"{path}: eos_token_id ({value!r}) must be an integer token id, a list of them, or null; "
                         f"write e.g. 2 or [128001, 128009]") from None
