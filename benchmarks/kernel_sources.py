"""A kernel's C source as another checkout has it (e.g. a `git worktree` of an earlier commit), for
the benchmarks that time it beside this checkout's build (`--from`, `--packed-from`)."""

from __future__ import annotations

import argparse
from pathlib import Path

MARK = '_SOURCE = r"""'


def checkout_with(flag: str, module: str):
    """An argparse type: a checkout whose `module` holds a kernel source, checked before any work (a
    wrong folder was a FileNotFoundError or "substring not found" after this host's kernels were built)."""
    def parse(text: str) -> str:
        path = Path(text) / module
        if not path.is_file() or MARK not in path.read_text():
            raise argparse.ArgumentTypeError(f"{flag} ({text}) is not a corelaunch checkout with a kernel source: "
                                             f"it has no {module} holding {MARK}...; pass a checkout's root "
                                             f"folder (e.g. a `git worktree` of another commit)")
        return text
    return parse


def c_source_in(checkout: str, module: str) -> str:
    """The `_SOURCE` string of `module` (a path like workers/kernels/packed_linear.py) in `checkout`."""
    text = (Path(checkout) / module).read_text()
    start = text.index(MARK) + len(MARK)
    return text[start:text.index('"""', start)]
