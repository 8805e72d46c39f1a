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
    pending, named = list(leftovers), []
    after_unknown = False
    for word in words:
        if word == "--":
            break
        if pending and word == pending[0]:  # the leftovers are a subsequence of the words
            named.append(pending.pop(0))
            after_unknown = after_unknown or _option_like(word)
        elif after_unknown and not _option_like(word):
            named.append(word)
        else:  # an option the parser knows, its value, or a positional before any unknown option
            after_unknown = False
    return named + pending


def _option_like(word: str) -> bool:
    """Whether argparse reads `word` as an option (known or not): a dash and more, not a negative number."""
    return len(word) > 1 and word.startswith("-") and _NEGATIVE_NUMBER.match(word) is None
