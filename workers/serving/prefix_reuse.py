"""Prefix caching over the serving cache's rows (the leader's bookkeeping; pure Python).

A request that ends normally leaves its row's keys and values in place: its prompt and the tokens it
generated (but the last, which no step fed back). The row remembers those token ids while it is
free. A new request whose prompt starts like what some row holds skips that prefix's prefill: its
first chunk starts at the end of the shared part. The row holding it is either a free row the
request is seated in, or a row it is copied from (a free row, or one whose request is still
running: what its steps have written so far) into the new request's row before the step's
forwards. At least the prompt's last token is always prefilled, since its logits choose the first
new token. Only rows whose last (or running) request sent the same cache_salt are shared (None, no
salt, is a salt of its own), so clients of different salts cannot time each other's prompts. (A
request that would gain at least MIN_SHARED_TOKENS more by waiting for a running request's prefill
of their shared prefix waits: scheduler.py; only for a request of its salt.)

What a row remembers is exactly what its cache holds: each slot's keys and values depend only on
the tokens at and before it (causal attention) and its position, so they are what a prefill of the
same tokens writes, up to float rounding where a prefill and a decode step (or chunks of other
sizes) compute them by different paths; workers/serving/loop.py keeps prefix caching off where a
key's rotation depends on its forward's length too (longrope past its original context). A row
whose last request's token choice failed (NaN logits, say), or that was cancelled before its
prompt's logits were read, is zeroed (scheduler.py's clears) and remembers nothing.

Choosing (RowHistories.choose): the row sharing the longest prefix with the prompt, if it shares at
least MIN_SHARED_TOKENS. A free row whose whole history the prompt starts with is taken as it is
(nothing else it holds is lost); otherwise the shared part is copied into a free row that remembers
nothing, so a longer history (another conversation behind the same system prompt) stays for its
own next turn. With no such row, some free row's history goes either way: the source's own past
where it and the prompt part, or the past of the row freed longest ago beyond what it shares with
the prompt. The smaller loss is taken (a tie keeps the source, with no copy): the source is taken
itself, else the shared part is copied into the row freed longest ago; a free source that would
lose fewer than MIN_SHARED_TOKENS (the same prompt sent again, say) is taken itself too, and where
rows share the prompt alike, the row freed longest ago is taken itself. A running source's prefix
goes into a free row that remembers nothing, else the one freed longest ago. Without a shared prefix: a free row
that remembers nothing (the lowest), then the one freed longest ago, so recent histories live
longest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Tokens

MIN_SHARED_TOKENS = 16
"""Shorter shared prefixes are prefilled again. Distinct prompts often share a few leading tokens (a
word and a space); skipping those saves little, while with compiling a chunk that continues a row
runs in another prefill call than the chunks that start theirs at slot 0 in the same step."""


MAX_WINDOW = 1024
"""The widest slice common_prefix_length compares at once."""


def common_prefix_length(a: Tokens[int], b: Tokens[int]) -> int:
    """How many leading ids a and b share, by slice comparisons (which run in C): over windows that
    double from the start, then a bisection inside the first window where they differ. Its cost
    follows the shared length, not a and b's: the scheduler compares every running row's tokens
    (thousands each) with a waiting prompt that often shares a system prompt or nothing. a and b
    only need len() and slicing (a list, a tuple, scheduler.py's view of a row)."""
    end = min(len(a), len(b))
    low, width = 0, 64  # a[:low] == b[:low]
    while low < end:
        high = min(low + width, end)
        if not _same_ids(a, b, low, high):
            return _bisect_common(a, b, low, high - 1)
        # capped: the bisection inside the last window copies it about twice, which cost more than
        # the old whole-input bisection where most of a long prefix was shared
        low, width = high, min(width * 2, MAX_WINDOW)
    return low


def _same_ids(a: Tokens[int], b: Tokens[int], start: int, stop: int) -> bool:
    return tuple(a[start:stop]) == tuple(b[start:stop])  # tuple(): a list's slice never equals a tuple's


def _bisect_common(a: Tokens[int], b: Tokens[int], low: int, high: int) -> int:
    """The shared length, given a[:low] == b[:low] and that it is at most high."""
    while low < high:
        middle = (low + high + 1) // 2
        if _same_ids(a, b, low, middle):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(frozen=True)
class Seat:
    row: int
    """The free row the request takes."""
    cached: int = 0
    """Prompt tokens already there once the step's copies ran: never prefilled."""
    copy_from: int | None = None
    """The row whose first `cached` slots are copied into `row` first; None: none."""


class RowHistories:
    """The token ids each free row's cache holds, and which free row a new prompt should take."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, ...]] = {}
        self._salts: dict[int, str | None] = {}
        """The cache_salt of the request that left each row of _held: only requests of that salt share it."""
        self._freed_order: dict[int, int] = {}
        self._clock = 0

    def keep(self, row: int, token_ids: Tokens[int], salt: str | None = None) -> None:
        """The row is free and its first len(token_ids) slots hold these tokens, written by a request
        of this cache_salt."""
        self._clock += 1
        if token_ids:
            self._held[row] = tuple(token_ids)
            self._salts[row] = salt
            self._freed_order[row] = self._clock
        else:
            self.forget(row)

    def forget(self, row: int) -> None:
        """The row was taken, or zeroed: nothing of it can be reused."""
        self._held.pop(row, None)
        self._salts.pop(row, None)
        self._freed_order.pop(row, None)

    def held(self, row: int) -> tuple[int, ...]:
        return self._held.get(row, ())

    def choose(self, free_rows: list[int], prompt: Tokens[int], reuse: bool,
               in_use: dict[int, tuple[str | None, Tokens[int]]] | None = None, salt: str | None = None) -> Seat:
        """Where a prompt about to be seated in one of free_rows (not empty) goes (the module
        docstring says how). in_use: the rows of running requests, each with (its request's
        cache_salt, the token ids its slots hold: a prompt being prefilled, the part written so
        far), which can be copied from. salt: the prompt's request's cache_salt; only rows of the
        same salt are shared (any free row can still be written over). reuse False: the prompt
        shares nothing (it wants every prompt position's logits) and is seated as one that matched
        nothing."""
        blank = [row for row in free_rows if row not in self._held]
        fresh = min(blank) if blank else min(free_rows, key=lambda row: self._freed_order[row])
        if not reuse or len(prompt) < 2:
            return Seat(fresh)
        best_row, best, best_common = None, 0, 0
        fresh_common = 0  # what `fresh` shares with the prompt, where it is a candidate (its own salt)
        candidates = [(row, self._held[row]) for row in free_rows if row in self._held and self._salts[row] == salt]
        running = [(row, held) for row, (row_salt, held) in (in_use or {}).items() if row_salt == salt]
        for row, held in candidates + running:
            common = common_prefix_length(held, prompt)
            if row == fresh:
                fresh_common = common
            shared = min(common, len(prompt) - 1)
            # on a tie, the row a copy would go to (seated there itself, nothing is copied), unless the
            # row found first loses nothing of its own (its whole history is the prompt's start)
            tie_to_fresh = shared == best and row == fresh and not self._whole_start(best_row, best)
            if (shared > best or tie_to_fresh) and shared >= MIN_SHARED_TOKENS:
                best_row, best, best_common = row, shared, common
        if best_row is None:
            return Seat(fresh)
        if best_row in self._held and self._taken_as_it_is(best_row, best, best_common, fresh, bool(blank),
                                                           fresh_common):
            return Seat(best_row, best)
        return Seat(fresh, best, best_row)

    def _whole_start(self, row: int | None, shared: int) -> bool:
        """Whether free row `row` holds nothing beyond the `shared` slots a prompt starts with."""
        return row in self._held and shared >= len(self._held[row])

    def _taken_as_it_is(self, row: int, shared: int, common: int, fresh: int, blank_left: bool,
                        fresh_common: int) -> bool:
        """Whether a prompt sharing `shared` slots with free row `row` (`common` tokens, counting the
        last prompt token, which is prefilled again) is seated there, not copied into `fresh`."""
        history = len(self._held[row])
        if shared >= history or fresh == row:
            return True  # its whole history is the prompt's start, or it is the row a copy would go to
        if blank_left:
            return False  # a copy into a blank row costs no history at all
        # Either this row loses its past beyond `common` (the prefill writes the same tokens up to
        # there) or `fresh`, the free row freed longest ago, loses its own past beyond what it shares
        # with the prompt: the smaller loss is taken (a tie keeps the row, with no copy). Always
        # copying into `fresh` wiped conversations waiting for their next turn to keep a one-off's
        # leftovers; always taking the row wiped a conversation for a prompt sharing only its
        # system prompt. A past too short to be reused is not worth a copy either.
        # fresh_common: what it shares with the prompt, which stays only for its own salt (0 for
        # another: after the copy those slots are the prompt's)
        loses_there = len(self._held[fresh]) - fresh_common
        return history - common < MIN_SHARED_TOKENS or history - common <= loses_there
