"""Stop strings over streamed text: emit what cannot be part of a stop string, hold the rest.

A stop string can arrive split across any number of deltas ("<|e", "nd", "|>"), so text that could
still grow into one is held back. Only a tail that is a prefix of some stop string needs holding,
and such a tail is shorter than the longest stop, so at most max(len(stop)) - 1 characters wait.
Once a stop string is found (the one that ends first), it and everything after it are dropped (OpenAI's behaviour: the stop
sequence is not part of the returned text), or, with include_stop (vLLM's include_stop_str_in_output),
only what comes after it: the text then ends with the stop string. Then nothing needs holding
back, as in vLLM: all the text sent before the stop string completes belongs in the output, so
every delta goes out at once, and only the last max(len(stop)) - 1 characters sent are kept, for a
stop string that begins in them and ends in a later delta.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 4
"""OpenAI's completions and chat APIs accept up to 4 stop sequences."""


def validate_stops(stops: Sequence[str]) -> tuple[str, ...]:
    """The stops as a tuple; ValueError naming the value for anything else than up to 4 non-empty
    strings (None: none). A lone string is refused (it would be read as one stop per character)."""
    if stops is None:
        return ()
    if isinstance(stops, str):
        raise ValueError(f"stop strings must be a list of strings, got the single string {stops!r}; "
                         f"wrap it in a list: [{stops!r}]")
    if isinstance(stops, (bytes, bytearray)) or not hasattr(stops, "__iter__"):
        raise ValueError(f"stop strings must be a list of strings, got {stops!r}")
    stops = tuple(stops)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (OpenAI's limit), got "
                         f"{len(stops)}: {list(stops)!r}")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str) or not stop:
            raise ValueError(f"each stop string must be a non-empty str, got {stop!r} in {list(stops)!r}")
        try:
            stop.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: no decoded text holds it, so it never stopped
            raise ValueError(f"stop string {i} is not valid UTF-8 text ({stop!r}: {err.reason} at position "
                             f"{err.start}); pass UTF-8 text") from None
    return stops


def held_tail_length(text: str, starts: Sequence[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `starts` (text that
    may still grow into one of them, so is held back until the next piece says)."""
    for length in range(min(max((len(s) for s in starts), default=1) - 1, len(text)), 0, -1):
        tail = text[-length:]
        if any(start.startswith(tail) for start in starts):
            return length
    return 0


class StopStringMatcher:
    """Feed text deltas with push(); each returns (text safe to emit now, whether a stop was found).

    After a stop is found every later push returns ("", True): the request is over, and `found` is
    the stop string that ended it (the API's stop_reason). include_stop: the text emitted ends with
    the stop string found (vLLM's include_stop_str_in_output), not before it.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = validate_stops(stops)
        self.include_stop = include_stop
        self._hold_max = max((len(s) for s in self.stops), default=1) - 1
        """The longest tail that can still be the start of a stop string."""
        self._held = ""
        self._sent_tail = ""
        """include_stop: the end of the text already emitted, where a stop string may begin."""
        self._unmatchable = 0
        """How many of the held characters came in a push that looked for no stop (min_tokens): a stop
        string may begin in them but must end after them."""
        self.stopped = False
        self.found: str | None = None
        """The stop string that ended the text, once one has: a client told which of its stops matched
        need not search the text for it (with include_stop it is not even cut off)."""

    @property
    def held(self) -> str:
        """Text received but not yet emitted, because it may begin a stop string."""
        return self._held

    def push(self, text: str, match: bool = True) -> tuple[str, bool]:
        """match False (text of the tokens within min_tokens): no stop string ends in this text, but a
        tail that may begin one is still held, so a stop string that begins here and ends in a later
        push is found there (vLLM's rule: a stop string must end after the first min_tokens tokens)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        if self.include_stop:
            return self._push_unheld(text, match)
        buffer = self._held + text
        found = self._first_stop(buffer, self._unmatchable) if match else None
        if found is not None:
            start, end = found
            self._stop_at(buffer[start:end])
            self._held = ""
            return buffer[:end if self.include_stop else start], True
        keep = held_tail_length(buffer, self.stops)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        self._unmatchable = keep if not match else max(0, self._unmatchable - (len(buffer) - keep))
        return buffer[:len(buffer) - keep], False

    def _push_unheld(self, text: str, match: bool) -> tuple[str, bool]:
        """push() with include_stop: everything up to the end of the first stop string that ends in
        `text` (one may begin in the text sent before), else all of `text`."""
        sent = self._sent_tail
        buffer = sent + text
        found = self._first_stop(buffer, len(sent)) if match else None  # ends in the new text
        if found is not None:
            self._stop_at(buffer[found[0]:found[1]])
            return buffer[len(sent):found[1]], True
        self._sent_tail = buffer[-self._hold_max:] if self._hold_max else ""
        return text, False

    def _stop_at(self, stop: str) -> None:
        self.stopped, self.found = True, stop

    def flush(self) -> str:
        """The held tail, at the end of a request that hit no stop string (it never completed one)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_stop(self, buffer: str, ends_after: int) -> tuple[int, int] | None:
        """(start, end) in buffer of the stop string that ends first after buffer[:ends_after], or None:
        the one the model's text completed first, as text arriving a character at a time finds it,
        so the answer does not depend on how the text was cut into tokens or events. The earliest
        start instead cut " Hello world" before " world" when it came in one token but before "or"
        (" Hello w") when " wor" and "ld" came apart (stops " world" and "or"), and could carry
        include_stop's text past a stop already completed ("w; X" over "; " in "now; X"). Of stops
        ending at one place ("ab" and "b"), the one starting earliest: none of it is returned text."""
        spans = [(i, i + len(stop)) for stop in self.stops
                 if (i := buffer.find(stop, max(0, ends_after - len(stop) + 1))) >= 0]
        return min(spans, key=lambda span: (span[1], span[0]), default=None)

