"""The words argparse left over, named with the values that went with them.

argparse gives a value that follows an option it does not know to the subcommand's positionals
when they still take words (generate's and check's prompts): `check --bogus 7` was refused as
"unrecognized arguments: --bogus", the 7 read as a prompt, while bench, without positionals, named
both. The refusal is the same either way; only what it names changes.
"""
from __future__ import annotations

import re

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""argparse's own test for a negative number, which it reads as a value, not an option."""


def named_with_their_values(words: list[str], leftovers: list[str]) -> list[str]:
    """`leftovers` (what argparse left of `words`, in their order) with the words that followed each
    unknown option up to the next option-like word put back after it. Stops at `--`, after which
    every word is a positional."""
    before = words[:words.index("--")] if "--" in words else list(words)
    left = _leftover_places(before, leftovers)
    named, after_unknown = [], False
    for place, word in enumerate(before):
        if place in left:
            named.append(word)
            after_unknown = after_unknown or option_like(word)
        elif after_unknown and not option_like(word):
            named.append(word)
        else:  # an option the parser knows, its value, or a positional before any unknown option
            after_unknown = False
    return leftovers[:len(leftovers) - len(left)] + named  # any not found among the words: as argparse left them


def _leftover_places(words: list[str], leftovers: list[str]) -> set[int]:
    """Where each leftover stands among `words`, matched from the right: a stray positional comes
    after the run of them argparse took (`--bogus B A --max-new-tokens 4 B` left the last B, not the
    first)."""
    places, pending = set(), list(leftovers)
    for place in range(len(words) - 1, -1, -1):
        if pending and words[place] == pending[-1]:
            places.add(place)
            pending.pop()
    return places


def option_like(word: str) -> bool:
    """Whether argparse reads `word` as an option (known or not): a dash and more, not a negative number."""
    return len(word) > 1 and word.startswith("-") and _NEGATIVE_NUMBER.match(word) is None
