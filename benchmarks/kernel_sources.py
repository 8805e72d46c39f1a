"""A kernel's C source as another checkout has it (e.g. a `git worktree` of an earlier commit), for
the benchmarks that time it beside this checkout's build (`--from`, `--packed-from`)."""

from __future__ import annotations

from pathlib import Path

MARK = '_SOURCE = r"""'


def c_source_in(checkout: str, module: str) -> str:
    """The `_SOURCE` string of `module` (a path like workers/kernels/packed_linear.py) in `checkout`."""
    text = (Path(checkout) / module).read_text()
    start = text.index(MARK) + len(MARK)
    return text[start:text.index('"""', start)]
