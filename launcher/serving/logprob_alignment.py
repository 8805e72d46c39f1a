"""Log-probabilities kept in step with the response's text.

The engine sends each token's log-probability with the token, but the text can lag behind it: text
that may begin a stop string, or bytes of an unfinished character, are held back (StreamDelta.text).
A client reading a stream expects the tokens it is told about to be in the text it has, and a stop
string's tokens never to appear, as the stop string itself never does (unless the request asked for
include_stop_str_in_output: then the cut is after the stop string, and its tokens are in the text).
So each entry waits here until the text sent reaches the token's first byte, and when a stop string
ends the request the entries that start at or past the cut are dropped. A token that straddles the cut (its bytes begin
before the stop string) is kept: part of it was sent; so is a token that adds nothing to the text
(a skipped special token) right at the cut.

Where a token starts is counted in bytes, not by its `text_offset`: the tokens of a character split
over several share one offset (the text before the character, launcher/serving/token_pieces.py),
though only the first may begin before a stop string that starts with that character.
"""

from __future__ import annotations

import codecs
from collections import deque
from dataclasses import dataclass

from launcher.serving.stream_types import StreamDelta
from launcher.serving.token_pieces import TextOffsets, TokenPieces
from workers.serving.requests import TokenLogprob


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


@dataclass
class _Placed:
    entry: TokenLogprob
    offset: int
    """Characters of text emitted before the token (completions' text_offset)."""
    start_byte: int
    """Bytes of the text before the token's own first byte."""
    adds_bytes: bool


class AlignedLogprobs:
    """push(delta) -> the (entry, text offset) pairs whose text has now been sent, in order."""

    def __init__(self, pieces: TokenPieces, skip_special_tokens: bool = True) -> None:
        """skip_special_tokens: as the response's text is decoded (the request's skip_special_tokens)."""
        self._pieces = pieces
        self._offsets = TextOffsets(pieces.tokenizer, skip_special_tokens)
        self._bytes = 0  # emitted by the offsets' detokenizer so far
        self._held = b""  # the bytes of split characters' tokens not emitted yet
        self._waiting: deque[_Placed] = deque()
        self._sent_bytes = 0

    def _place(self, entry: TokenLogprob) -> _Placed:
        token = entry.token_id
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
        return _Placed(entry, offset, start_byte, adds)

    def push(self, delta: StreamDelta) -> list[tuple[TokenLogprob, int]]:
        for entry in delta.logprobs or ():
            self._waiting.append(self._place(entry))
        self._sent_bytes += len(delta.text.encode())
        if delta.finish_reason is not None:
            # The end: everything the text holds is sent. Past a stop string's cut lie only the stop
            # string's tokens; otherwise what is left starts at the very end (a special token that
            # decodes to nothing, the last bytes of an unfinished character) and belongs to the text.
            ready = [p for p in self._waiting if not delta.stopped_by_string or self._before_the_cut(p)]
            self._waiting.clear()
            return [(p.entry, p.offset) for p in ready]
        ready = []
        while self._waiting and self._waiting[0].start_byte < self._sent_bytes:
            ready.append(self._waiting.popleft())
        return [(p.entry, p.offset) for p in ready]

    def _before_the_cut(self, placed: _Placed) -> bool:
        return placed.start_byte < self._sent_bytes or (placed.start_byte == self._sent_bytes and not placed.adds_bytes)
