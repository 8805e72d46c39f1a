"""A clock a test moves by hand, for code that takes its time source as a callable (the response
store's record lives, the replica pool's pace of ends)."""

from __future__ import annotations


class ManualClock:
    """Returns `now`, which the test sets."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
