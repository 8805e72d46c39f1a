"""Prefix caching over the serving cache's rows (the leader's bookkeeping; pure Python).

A request that ends normally leaves its row's keys and values in place: its prompt and the tokens it
generated (but the last, which no step fed back). The row remembers those token ids while it is
free. A new request seated in a free row whose remembered ids start like its prompt skips that
prefix's prefill: its first chunk starts at the end of the shared part. At least the prompt's last
token is always prefilled, since its logits choose the first new token.

What a row remembers is exactly what its cache holds: each slot's keys and values depend only on
the tokens at and before it (causal attention) and its position, so they are what a prefill of the
same tokens writes, up to float rounding where a prefill and a decode step (or chunks of other
sizes) compute them by different paths. A row whose last request failed, or was cancelled before
its prompt's logits were read, is zeroed (scheduler.py's clears) and remembers nothing.

Choosing a row: the free row sharing the longest prefix with the prompt, if it shares at least
MIN_SHARED_TOKENS; else a free row that remembers nothing (the lowest), then the one freed longest
ago, so recent histories live longest.
"""

from __future__ import annotations

from typing import Sequence as Tokens

MIN_SHARED_TOKENS = 16
"""Shorter shared prefixes are prefilled again. Distinct prompts often share a few leading tokens (a
word and a space); skipping those saves little, while with compiling a chunk that continues a row
runs in another prefill call than the chunks that start theirs at slot 0 in the same step."""
_PROBE = 64
"""Tokens compared at once before halving (tuple slices compare in C)."""


def common_prefix_length(a: Tokens[int], b: Tokens[int]) -> int:
    """How many leading ids a and b share."""
    limit = min(len(a), len(b))
    if tuple(a[:limit]) == tuple(b[:limit]):
        return limit
    shared = 0
    while shared < limit:  # grow by whole probes, then bisect inside the first that differs
        end = min(shared + _PROBE, limit)
        if tuple(a[shared:end]) == tuple(b[shared:end]):
            shared = end
            continue
        low, high = shared, end - 1  # the first difference lies in [shared, end)
        while low < high:
            middle = (low + high) // 2
            if tuple(a[shared:middle + 1]) == tuple(b[shared:middle + 1]):
                low = middle + 1
            else:
                high = middle
        return low
    return shared


class RowHistories:
    """The token ids each free row's cache holds, and which free row a new prompt should take."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, ...]] = {}
        self._freed_order: dict[int, int] = {}
        self._clock = 0

    def keep(self, row: int, token_ids: Tokens[int]) -> None:
        """The row is free and its first len(token_ids) slots hold these tokens."""
        self._clock += 1
        if token_ids:
            self._held[row] = tuple(token_ids)
            self._freed_order[row] = self._clock
        else:
            self.forget(row)

    def forget(self, row: int) -> None:
        """The row was taken, or zeroed: nothing of it can be reused."""
        self._held.pop(row, None)
        self._freed_order.pop(row, None)

    def held(self, row: int) -> tuple[int, ...]:
        return self._held.get(row, ())

    def choose(self, free_rows: list[int], prompt: Tokens[int], reuse: bool) -> tuple[int, int]:
        """(row, prompt tokens already in it) for a prompt about to be seated in one of free_rows
        (not empty). reuse False: the prompt shares nothing (it wants every prompt position's logits);
        the row is then chosen as for a prompt that matched nothing."""
        if reuse and len(prompt) > 1:
            best_row, best = None, 0
            for row in free_rows:
                held = self._held.get(row)
                if held:
                    shared = min(common_prefix_length(held, prompt), len(prompt) - 1)
                    if shared > best and shared >= MIN_SHARED_TOKENS:
                        best_row, best = row, shared
            if best_row is not None:
                return best_row, best
        blank = [row for row in free_rows if row not in self._held]
        if blank:
            return min(blank), 0
        return min(free_rows, key=lambda row: self._freed_order[row]), 0
