"""argparse types the benchmark scripts share, beside launcher.cli.options.int_at_least: a bad value
is refused before any work, with a message naming the flag, the value and what it must be (a count
of 0 otherwise ended in a division by zero, an empty median or a report of Infinity)."""

from __future__ import annotations

import argparse
import math


def int_list(name: str, example: str, minimum: int = 1):
    """Comma-separated integers, each >= minimum (e.g. --rows 1024,2048)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{name} ({text!r}) must be comma-separated integers of at least "
                                             f"{minimum}, e.g. {example}")
        return values
    return parse


def positive_seconds(name: str):
    """A number of seconds above 0 (a timeout of 0 or less fails every wait at once)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, not {text!r}") from None
        if not (value > 0 and math.isfinite(value)):  # also refuses nan
            raise argparse.ArgumentTypeError(f"{name} ({text}) must be a finite number of seconds above 0")
        return value
    return parse
