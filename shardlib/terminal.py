"""Whether this process's stderr is a terminal: progress drawn in place (bars, spinners, colours)
belongs there, and off one (a log file, CI) it is noise."""

from __future__ import annotations

import sys


def stderr_is_a_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False
