"""Type and range checks for the fields of a Hugging Face config.json.

Each check returns the value (normalized: a float for numbers) or raises a one-line ValueError
naming the field, the value it has and the fix, so a bad config.json is refused before any process
starts instead of failing inside a rank. JSON null counts as "absent" for optional fields (the
caller substitutes the default).
"""

from __future__ import annotations

import math
from typing import Any

MAX_CONFIG_INT = 2**31 - 1
MAX_LAYERS = 100_000
"""Far above any published model (Llama 3.1 405B has 126 layers): the config is read into per-layer
tuples, and 2**31 layers would take the machine's memory before any other check could answer."""
"""Largest count or size accepted: every real checkpoint's dimensions fit in an int32 (tensor
shapes and indices), and bounding them keeps the planner's byte arithmetic finite."""

_SHOW_LIMIT = 80


def show(value: Any) -> str:
    """repr(value) on one short line (long values cut, giant integers summarized)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit integer>"
    try:
        text = repr(value)
    except ValueError:  # e.g. an int too long for str() nested in a list
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _SHOW_LIMIT else text[:_SHOW_LIMIT - 3] + "..."


def field_error(name: str, value: Any, rule: str, fix: str) -> ValueError:
    """ValueError "config.json field NAME=VALUE RULE; FIX" (one line)."""
    return ValueError(f"config.json field {name}={show(value)} {rule}; {fix}")


def finite(value: int | float) -> bool:
    """math.isfinite, False rather than OverflowError for an int too large for a float (10**400)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(name: str, value: Any, example: int, *, minimum: int = 1, maximum: int = MAX_CONFIG_INT) -> int:
    """An integer in [minimum, maximum] (bool, float and string refused)."""
    if not _is_int(value) or not minimum <= value <= maximum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise field_error(name, value, f"must be {what} (at most {maximum})",
                          f"write a bare JSON integer such as {example}, not a string, float or bool")
    return value


def positive_number(name: str, value: Any, example: float) -> float:
    """A finite number > 0 (int or float; bool, string, nan and inf refused), as a float."""
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and finite(value) else None
    if number is None or number <= 0:
        raise field_error(name, value, "must be a finite number > 0",
                          f"write a bare JSON number such as {example}")
    return number


def flag(name: str, value: Any, default: bool = False, *, nullable: bool = True) -> bool:
    """true or false (null, where nullable: the default); 0, 1 and "true" refused."""
    if value is None and nullable:
        return default
    if not isinstance(value, bool):
        raise field_error(name, value, "must be true or false", "write a bare JSON true or false")
    return value


def mapping(name: str, value: Any, example: str) -> dict | None:
    """A JSON object or null."""
    if value is not None and not isinstance(value, dict):
        raise field_error(name, value, "must be a JSON object or null",
                          f"write it as an object such as {example}, or null for none")
    return value


def token_id(name: str, value: Any) -> int | None:
    """An integer token id or null."""
    if value is not None and not _is_int(value):
        raise field_error(name, value, "must be an integer token id or null",
                          "write a bare JSON integer such as 2, or null")
    return value


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    """An integer, a list of integers, or null (no ids) as a tuple."""
    ids = value if isinstance(value, (list, tuple)) else (() if value is None else (value,))
    if not all(_is_int(i) for i in ids):
        raise field_error(name, value, "must be an integer token id, a list of them, or null",
                          "write e.g. 2 or [128001, 128009]")
    return tuple(ids)
