"""The one check that a count (a TP degree, a batch size, a bucket length, max_new_tokens) is a
positive integer. bool is refused although it is an int in Python: True is never meant as 1."""

from __future__ import annotations

import operator


def is_positive_int(value) -> bool:
    """True for an int >= 1 that is not a bool (for checks whose message says more, e.g. "or 'auto'")."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_non_negative_int(value) -> bool:
    """True for an int >= 0 that is not a bool (0 meaning "none": no static batch, no serving loop)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def positive_int(name: str, value) -> int:
    """`value`, or ValueError "NAME (VALUE) must be a positive integer"."""
    if not is_positive_int(value):
        raise ValueError(f"{name} ({value!r}) must be a positive integer")
    return value


def integer_of_any_kind(value) -> int | None:
    """`value` as a Python int when it is an integer of any kind (numpy's and torch's 0-d ones
    included, as prompts take them), else None; bools (Python's, numpy's, torch's) are not integers."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def real_of_any_kind(value) -> int | float | None:
    """`value` as a Python int or float when it is a number of any kind (numpy's scalars, 0-d torch
    tensors of any dtype but bool), else None: checked like any other value, and plain on the ranks."""
    number = integer_of_any_kind(value)
    if number is not None:
        return number
    if type(value) is float:
        return value
    # numpy's scalars (np.float64 too, a float's subclass) and 0-d tensors have shape (); bools of
    # any kind are not numbers
    if getattr(value, "shape", None) != () or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
