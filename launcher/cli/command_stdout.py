"""The command's stdout kept for the command's own output while Ray is connected.

Ray's driver prints the cluster's messages (a worker that died, Serve's controller shut down) to
whatever `sys.stdout` is when they arrive, outside `log_to_driver`: a `--json` result then was not
one JSON object, and `corelaunch serve`'s stdout (its ready line) took Ray's lines after it. While
a command runs Ray, `sys.stdout` is stderr; the command writes its own output to the stdout it
saved.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO


@contextmanager
def ray_output_on_stderr() -> Iterator[TextIO]:
    """sys.stdout is sys.stderr inside the block; yields the stdout to write the command's output to."""
    own = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield own
    finally:
        sys.stdout = own


def run_reporting(main: Callable[[TextIO], None]) -> None:
    """Run a script's main(out), which prints its JSON report to `out`, with Ray's cluster messages
    on stderr: a benchmark that kills a rank on purpose printed Ray's "(raylet) A worker died"
    line before its report, and its stdout was no longer one JSON object."""
    if {"-h", "--help"} & set(sys.argv[1:]):  # argparse prints the help on sys.stdout and exits: no Ray
        main(sys.stdout)  # (it went to stderr: `script.py --help | less` showed nothing)
        return
    with ray_output_on_stderr() as stdout:
        main(stdout)
