"""Refusing a text prompt that cannot fit the context from its head alone.

The server tokenizes prompts one at a time (openai_app.py), so a prompt of megabytes held every
request behind it for as long as its tokenizing took (a 10 MB prompt, about 2 million tokens, held
another request 11.5 s before its own 400 on machine M). A text longer than PROBE_CHARS_PER_TOKEN
characters per context token has its head of that length tokenized first: a head with more than
twice the context's tokens shows the whole cannot fit, and the request is refused without tokenizing
the rest. A text whose head is sparse in tokens (long runs of spaces, say) is bounded by its length
instead: no token spans more characters than the vocabulary's longest piece, so a text longer than
LENGTH_MARGIN times that many characters per context token cannot fit and is refused without any
tokenizing. What is left to the full tokenizing is at most that long (81 characters a token for
SmolLM2: 1.3 million characters at a context of 8192, under 2 s of tokenizing on 2 cores).

Why twice (the head): a prefix's tokens are the whole text's tokens except near the cut, where a word cut in
two may take a few more tokens than the whole word. Twice the context leaves room for any cut, so a
prompt that fits is never refused here.
"""

from __future__ import annotations

from typing import Callable

PROBE_CHARS_PER_TOKEN = 16
"""Head length per context token. Text averages about 4 characters a token in English with the
tokenizers served here, so a head this long of ordinary text holds about 4 times the context's
tokens, well past the twice needed; tokenizing it costs a few tens of ms at a context of 8192."""


def head_overfills(count_tokens: Callable[[str], int], text: str, context_tokens: int) -> tuple[int, int] | None:
    """(head characters, head tokens) when `text`'s head alone holds more than twice
    `context_tokens` tokens (so the whole cannot fit); None when the whole text must be tokenized
    to know. `count_tokens` counts a text's tokens as the prompt would be tokenized."""
    head_chars = PROBE_CHARS_PER_TOKEN * context_tokens
    if len(text) <= head_chars:
        return None
    head_tokens = count_tokens(text[:head_chars])
    return (head_chars, head_tokens) if head_tokens > 2 * context_tokens else None


def too_long_message(what: str, head: tuple[int, int], context_tokens: int) -> str:
    head_chars, head_tokens = head
    return (f"{what} cannot fit the context: its first {head_chars} characters alone have {head_tokens} tokens "
            f"and the context holds {context_tokens}; shorten it")


LENGTH_MARGIN = 2
"""A text has at least len(text) / longest-piece tokens as written; a tokenizer's normalizer can
shorten it first (composing a letter and its accent into one character, say), so the bound allows
for text shortened to half before it refuses."""


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for: its vocabulary's longest piece (a byte-level
    piece has one symbol per byte, a SentencePiece piece one per character, added tokens their
    content). None when the tokenizer does not list its vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if get_vocab is not None else None
    return max(map(len, vocab), default=None) if vocab else None


def length_overfills(text: str, context_tokens: int, longest: int | None) -> bool:
    """Whether `text` is too long to fit `context_tokens` tokens whatever its tokens are."""
    return longest is not None and len(text) > LENGTH_MARGIN * longest * context_tokens


def too_many_characters_message(what: str, text: str, context_tokens: int, longest: int) -> str:
    return (f"{what} cannot fit the context: it has {len(text)} characters, no token of this model stands for "
            f"more than {longest} of them, and the context holds {context_tokens} tokens; shorten it")
