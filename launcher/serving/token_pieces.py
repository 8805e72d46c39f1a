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
  before them. Bytes no token completes come out as U+FFFD with the next whole token, which is
  placed after them (TokenPlacer: one placer for the completion's tokens and an echoed prompt's).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from launcher.serving.detokenizer import IncrementalDetokenizer, decode_text

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _fallback_byte(piece: str) -> bytes | None:
    """The byte a SentencePiece byte-fallback piece (`<0x20>`) stands for; None for any other piece."""
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    return bytes([int(fallback.group(1), 16)]) if fallback else None


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
        # a byte-level vocabulary, or one that spells "<0x20>" as text, has no byte-fallback pieces
        own_byte = None if self.byte_level or text == piece else _fallback_byte(piece)
        if own_byte is not None:
            # its byte, whatever decoding it alone gives: <0x20> alone is "" (the decoder strips a
            # leading space), which left both its text and its bytes empty. A byte past ASCII goes on
            # as part of a character (U+FFFD below: its text becomes its `bytes:` escape)
            text = "\ufffd" if own_byte[0] >= 0x80 else own_byte.decode()
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
        own_byte = _fallback_byte(piece)
        if own_byte:
            return own_byte
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

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids=()) -> None:
        """skip_special_tokens: as the text is decoded (a completion's skips them, an echoed prompt
        keeps them). prompt_ids: the prompt the response's text was primed with
        (launcher/serving/detokenizer.py), so the offsets count the same text."""
        self._text = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self.chars = 0

    @property
    def held_context(self) -> list[int]:
        """The prompt's last tokens whose character the first generated text completes."""
        return self._text.held_context

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


def _held_before(held: bytes, first: int | None) -> tuple[str, bytes]:
    """What of `held` (bytes of split characters' tokens not emitted yet) comes before a token whose
    first byte is `first` (None: a token that adds nothing): (the text it comes out as, the
    unfinished tail that token continues, b"" if none). Whole characters come as themselves, and
    where `first` does not continue the tail, whatever the decoder gives up comes as one U+FFFD per
    unfinished character, as UTF-8 decoding with replacement writes them. Byte-level BPE decoders do
    the same; SentencePiece's byte fallback replaces every byte of such a run
    (launcher/serving/detokenizer.py), so there a token after bytes the model never completed may be
    placed a few bytes early."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    whole = decoder.decode(held, final=False)
    tail = decoder.getstate()[0]
    if not tail or first is None or _continues(tail, first):
        return whole, tail
    return held.decode("utf-8", "replace"), b""


def _bytes_before(held: bytes, first: int | None) -> int:
    """How many bytes of text `held` will be before a token whose first byte is `first`: those of
    its text before the token's character, and the tail of that character it continues."""
    text, tail = _held_before(held, first)
    return len(text.encode()) + len(tail)


def _bytes_when_flushed(held: bytes) -> int:
    """The bytes of text `held` comes out as once no later byte can complete it."""
    return len(held.decode("utf-8", "replace").encode())


def _continues(tail: bytes, first: int) -> bool:
    try:
        codecs.utf_8_decode(tail + bytes([first]), "strict", False)  # an unfinished but valid prefix passes
        return True
    except UnicodeDecodeError:
        return False


@dataclass(frozen=True)
class Placement:
    offset: int
    """Characters of text emitted before the token (completions' text_offset)."""
    start_byte: int
    """Bytes of the text before the token's own first byte."""
    adds_bytes: bool
    """False for a token that adds nothing to the text (a skipped special token)."""
    text: str
    """The text the detokenizer emitted on taking the token."""


class TokenPlacer:
    """Where each token of a text starts, in characters and in bytes, for the completion's tokens
    (launcher/serving/logprob_alignment.py) and an echoed prompt's (launcher/serving/echoed_prompt.py)
    alike. TextOffsets alone counts the text emitted before a token, which misses the U+FFFD of bytes
    no token completes (they come out only with the next whole token): so an echoed prompt's
    dangling bytes all sat at 0 where the same tokens generated sat at 0, 1, 2."""

    def __init__(self, pieces: TokenPieces, skip_special_tokens: bool = True, prompt_ids=()) -> None:
        self._pieces = pieces
        self._offsets = TextOffsets(pieces.tokenizer, skip_special_tokens, prompt_ids)
        self._bytes = 0  # emitted by the offsets' detokenizer so far
        # the bytes of split characters' tokens not emitted yet: the prompt's own where it ends inside a
        # character (the first generated text brings that character out whole); a skipped special
        # token the prompt ends with is held too, but adds no bytes
        self._held = b"".join(pieces.bytes(t) for t in self._offsets.held_context if pieces.part_of_a_character(t))

    def place(self, token: int) -> Placement:
        offset, new = self._offsets.place(token)
        emitted = new.encode()
        new_bytes = len(emitted)
        own = self._pieces.bytes(token)
        if self._pieces.part_of_a_character(token):
            # Its own bytes come out later, with the character they complete (or as U+FFFD), after
            # what is held: its offset counted the text emitted only (a stray byte's U+FFFD was missed)
            start_byte = self._bytes + _bytes_before(self._held, own[0])
            offset += len(_held_before(self._held, own[0])[0])
            self._held += own
            adds = True
        elif new_bytes:
            # What was held comes out first, then the token's own text: it starts where that text
            # begins at the end of what was emitted, and so does its offset (it was the start of
            # the held bytes' U+FFFD, where the token's text was read at that offset)
            within = max(_bytes_when_flushed(self._held), new_bytes - len(own))
            start_byte = self._bytes + within
            offset += len(emitted[:within].decode("utf-8", "replace"))
            adds = True
        else:  # a skipped special token: nothing emitted, whatever is held stays held
            start_byte = self._bytes + _bytes_before(self._held, None)
            adds = False
        if new_bytes:  # the detokenizer emitted every token it held
            self._held = b""
        self._bytes += new_bytes
        return Placement(offset, start_byte, adds, new)

    def flush(self) -> str:
        """The text still held once no token follows."""
        return self._offsets.flush()
