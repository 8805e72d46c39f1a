"""Start-up progress on stderr (stdout stays clean for --json output)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console


class Progress:
    """Prints one line per start-up step with its duration; silent when disabled."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._console = Console(stderr=True, highlight=False)

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
        with self._console.status(f"{what} ...", spinner="dots"):
            yield

    def done(self, what: str, seconds: float) -> None:
        """A step's line, with its duration (measured by the caller: step(), or a load on a thread)."""
        if self.enabled:
            self._console.print(f"[green]✓[/green] {what} ({seconds:.1f} s)")

    def note(self, text: str) -> None:
        if self.enabled:
            self._console.print(text)
