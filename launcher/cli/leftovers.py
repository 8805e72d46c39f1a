"""The words argparse left over, named with the values that went with them.

argparse gives a value that follows an option it does not know to the subcommand's positionals
when they still take words (generate's and check's prompts): `check --bogus 7` was refused as
"unrecognized arguments: --bogus", the 7 read as a prompt, while bench, without positionals, named
both. The refusal is the same either way; only what it names changes.
"""
from __future__ import annotations

import argparse
import re

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""argparse's own test for a negative number, which it reads as a value, not an option."""


def value_options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The parser's options that take values: option string -> whether it takes several."""
    return {string: action.nargs in ("*", "+") or isinstance(action.nargs, int) and action.nargs > 1
            for action in parser._actions if action.nargs != 0 for string in action.option_strings}


def named_with_their_values(words: list[str], leftovers: list[str],
                            options: dict[str, bool] | None = None) -> list[str]:
    """`leftovers` (what argparse left of `words`, in their order) with the word that followed each
    unknown option put back after it, unless it is option-like or a known option's. `options` (value_options of
    the parser) marks the words known options took, never taken for a leftover. Stops at `--`, after
    which every word is a positional."""
    before = words[:words.index("--")] if "--" in words else list(words)
    known = _taken_by_known_options(before, options or {})
    left = _leftover_places(before, leftovers, known)
    named, after_unknown = [], False
    for place, word in enumerate(before):
        if place in left:
            named.append(word)
            after_unknown = option_like(word)
        elif after_unknown and place not in known and not option_like(word):
            named.append(word)  # its value, as most options take one; the words after it are prompts
            after_unknown = False
        else:  # an option the parser knows, its value, or a positional
            after_unknown = False
    return leftovers[:len(leftovers) - len(left)] + named  # any not found among the words: as argparse left them


def _taken_by_known_options(words: list[str], options: dict[str, bool]) -> set[int]:
    """The places of the known options that take values and of their values (`--tp 2`: both; a word
    `--tp=2` holds its own)."""
    places, taking, several = set(), False, False
    for place, word in enumerate(words):
        if taking and not option_like(word):
            places.add(place)
            taking = several
            continue
        taking = word in options
        several = options.get(word, False)
        if taking:
            places.add(place)
    return places


def _leftover_places(words: list[str], leftovers: list[str], known: set[int]) -> set[int]:
    """Where each leftover stands among `words`, matched from the right among the words no known
    option took: a stray positional comes after the run of them argparse took (`--bogus B A
    --max-new-tokens 4 B` left the last B, not the first)."""
    places, pending = set(), list(leftovers)
    for place in range(len(words) - 1, -1, -1):
        if pending and place not in known and words[place] == pending[-1]:
            places.add(place)
            pending.pop()
    return places


def option_like(word: str) -> bool:
    """Whether argparse reads `word` as an option (known or not): a dash and more, not a negative number."""
    return len(word) > 1 and word.startswith("-") and _NEGATIVE_NUMBER.match(word) is None
