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
"""A text has at least len(text) / longest-piece tokens as written; composing a letter and its
accent (NFC, NFKC: at most 1.5 characters of text per byte) can shorten it first, so the bound
allows for text shortened to half before it refuses."""

_KEEPS_TEXT_NORMALIZERS = {"Prepend", "Lowercase"}
"""Normalizers that never shorten a text (Replace too, when its replacement is not empty)."""
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
"""Shorten text by composing characters: within LENGTH_MARGIN only for byte-level pieces."""
_KEEPS_TEXT_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation"}
"""Pre-tokenizers that drop no character (Split too, unless its pattern's matches are removed);
Whitespace, WhitespaceSplit and BERT's drop whitespace, and a text of spaces has no tokens."""


def _parts(component: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer as its list of steps (a Sequence unrolled)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [part for inner in component.get(key, []) for part in _parts(inner, key)]
    return [component]


def length_bound_holds(spec: dict) -> bool:
    """Whether every token of the tokenizer described by `spec` (its tokenizer.json) stands for at
    most its vocabulary piece's length in characters of the text as sent, up to LENGTH_MARGIN: the
    text is not shortened before it is cut into pieces (beyond composing characters, for byte-level
    pieces), and no run of text becomes one unknown token. Where this cannot be shown, no bound."""
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    for step in _parts(spec.get("normalizer"), "normalizers"):
        kind = step.get("type")
        if not (kind in _KEEPS_TEXT_NORMALIZERS or (kind == "Replace" and step.get("content"))
                or (kind in _COMPOSING_NORMALIZERS and byte_level)):
            return False
    for step in pre:
        kind = step.get("type")
        if not (kind in _KEEPS_TEXT_PRE_TOKENIZERS or (kind == "Split" and step.get("behavior") != "Removed")):
            return False
    model = spec.get("model") or {}
    # byte-level pieces spell any text; otherwise only byte fallback keeps unknown text from fusing
    return model.get("type") in ("BPE", "Unigram") and (byte_level or bool(model.get("byte_fallback")))


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for: its vocabulary's longest piece (a byte-level
    piece has one symbol per byte, a SentencePiece piece one per character, added tokens their
    content). None when the tokenizer does not describe itself, or its pipeline can shorten text or
    fold it into unknown tokens (length_bound_holds): then nothing is refused by length.
    `tokenizer`: a transformers fast tokenizer or a tokenizers.Tokenizer."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str") or not hasattr(backend, "get_vocab"):
        return None
    if not length_bound_holds(json.loads(backend.to_str())):
        return None
    return max(map(len, backend.get_vocab(with_added_tokens=True)), default=None)


def length_overfills(text: str, context_tokens: int, longest: int | None) -> bool:
    """Whether `text` is too long to fit `context_tokens` tokens whatever its tokens are."""
    return longest is not None and len(text) > LENGTH_MARGIN * longest * context_tokens


def too_many_characters_message(what: str, text: str, context_tokens: int, longest: int) -> str:
    return (f"{what} cannot fit the context: it has {len(text)} characters, no token of this model stands for "
            f"more than {longest} of them, and the context holds {context_tokens} tokens; shorten it")
