"""Whether a stream (most often this process's stderr) is a terminal: progress drawn in place (bars, spinners, colours)
belongs there, and off one (a log file, CI) it is noise."""

from __future__ import annotations

import sys


def stderr_is_a_terminal() -> bool:
    return stream_is_a_terminal(sys.stderr)


def stream_is_a_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False
