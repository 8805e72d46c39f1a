"""Start-up progress on stderr (stdout stays clean for --json output)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape


class Progress:
    """Prints one line per start-up step with its duration; silent when disabled. Every text given is
    printed as it is, never read as rich markup: an error quoted in a note (gloo's start with
    "[/path/unbound_buffer.cc:78]") raised MarkupError, and the replica whose restart it announced
    was given up."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        # emoji off: rich read ":100:" in a compiler's "k.c:100:5" and ":up:" in a path as emoji codes
        self._console = Console(stderr=True, highlight=False, emoji=False)
        # Off a terminal rich wraps at 80 columns, which split a quoted path or command (and a long
        # step's line) in two in a log. On one its wrapping stays: the spinner redraws in place only
        # over lines as wide as the terminal.
        self._console.soft_wrap = not self._console.is_terminal

    @contextmanager
    def step(self, what: str):
        start = time.perf_counter()
        with self.spinner(what):
            yield
        self.done(what, time.perf_counter() - start)

    @contextmanager
    def spinner(self, what: str):
        """The spinner of a step, without its line (the caller prints one with done())."""
        if not self.enabled:
            yield
            return
        with self._console.status(f"{escape(what)} ...", spinner="dots"):
            yield

    def done(self, what: str, seconds: float) -> None:
        """A step's line, with its duration (measured by the caller: step(), or a load on a thread)."""
        if self.enabled:
            self._console.print(f"[green]✓[/green] {escape(what)} ({seconds:.1f} s)")

    def note(self, text: str) -> None:
        if self.enabled:
            self._console.print(text, markup=False)
