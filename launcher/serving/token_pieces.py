"""What the log-probabilities of a response say about one token: its text, its bytes, and where it
starts in the generated text.

A token can be part of a character: SmolLM2's byte-level BPE spells an emoji as three or four
tokens of one or two bytes each. Decoded alone, such a token is U+FFFD, so its text cannot be
its `bytes` (clients join the bytes of consecutive tokens to rebuild the character), several
alternatives would share one key in completions' `top_logprobs`, and summing the lengths of those
texts misplaces every later `text_offset`. So:
- `bytes` are the token's own bytes: from the byte-level alphabet (the byte each character of the
  tokenizer's piece stands for), or a SentencePiece byte-fallback piece (`<0xE2>`); otherwise the
  UTF-8 of its text;
- its text is the decoded text when that is whole characters, else `bytes:` and the bytes as
  `\\xNN` escapes (the spelling OpenAI's API uses for such tokens). A SentencePiece word piece
  (`▁is`) keeps its space, which decoding it alone strips (Llama's and Mistral's decoders drop the
  first character of a text when it is a space);
- `text_offset` is the length of the text emitted before the token by the same incremental
  detokenizer that writes the response's text (launcher/serving/detokenizer.py), so it counts what
  the text holds whatever the tokenizer: no space a decoder strips, no special token it skips. The
  detokenizer holds back text until its last character is whole, so the tokens of a character split
  over several (and of whatever their first one carries before it) share the offset of the text
  before them.
"""

from __future__ import annotations

import re

from launcher.serving.detokenizer import IncrementalDetokenizer, decode_text

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 are moved to code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


class TokenPieces:
    """A tokenizer's per-token text and bytes, cached by id (a response asks for the same few often)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._partial: set[int] = set()

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        text = decode_text(self.tokenizer, [token_id], skip_special_tokens=False)  # as the text is decoded
        piece = self._piece_name(token_id)
        if not self.byte_level:  # a word piece decoded alone lost one leading space
            lead, have = len(piece) - len(piece.lstrip("\u2581")), len(text) - len(text.lstrip(" "))
            text = " " * max(lead - have, 0) + text
        raw = text.encode()
        if "\ufffd" in text:  # part of a character, or a character the tokenizer could not decode
            raw = self._raw_bytes(token_id) or raw
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                self._partial.add(token_id)
        self._cache[token_id] = (text, raw)
        return text, raw

    def _piece_name(self, token_id: int) -> str:
        """The vocabulary's own spelling of the token ("" when the tokenizer cannot say)."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else None
        return piece if isinstance(piece, str) else ""

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self._piece_name(token_id)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self.byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None

    def text(self, token_id: int) -> str:
        return self._piece(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        return self._piece(token_id)[1]

    def part_of_a_character(self, token_id: int) -> bool:
        """Whether the token's bytes are not whole characters: its text is `bytes:` and escapes."""
        self._piece(token_id)
        return token_id in self._partial


class TextOffsets:
    """Each generated token's offset, in characters, into the response's text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        """skip_special_tokens: as the text is decoded (a completion's skips them, an echoed prompt
        keeps them)."""
        self._text = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.chars = 0

    def place(self, token_id: int) -> tuple[int, str]:
        """(the offset of this token, the text the detokenizer emitted on taking it)."""
        offset, text = self.chars, self._text.push([token_id])
        self.chars += len(text)
        return offset, text

    def flush(self) -> str:
        """The text still held (the end of an unfinished character), once no token follows."""
        text = self._text.flush()
        self.chars += len(text)
        return text
