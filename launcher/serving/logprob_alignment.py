"""Log-probabilities kept in step with the response's text.

The engine sends each token's log-probability with the token, but the text can lag behind it: text
that may begin a stop string, or bytes of an unfinished character, are held back (StreamDelta.text).
A client reading a stream expects the tokens it is told about to be in the text it has, and a stop
string's tokens never to appear, as the stop string itself never does (unless the request asked for
include_stop_str_in_output: then the cut is after the stop string, and its tokens are in the text).
So each entry waits here until the text sent reaches the token's first byte, and when a stop string
ends the request the entries that start at or past the cut are dropped; so is the entry of a stop
token (an EOS, a stop token id) whose text the text leaves out (StreamDelta.stop_token_hidden). A
token that straddles the cut (its bytes begin before the stop string) is kept: part of it was sent;
so is a token that adds nothing to the text (a skipped special token) right at the cut.

Where a token starts is counted in bytes, not by its `text_offset`: the tokens of a character split
over several share one offset (the text before the character, launcher/serving/token_pieces.py),
though only the first may begin before a stop string that starts with that character.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from launcher.serving.stream_types import StreamDelta
from launcher.serving.token_pieces import Placement, TokenPieces, TokenPlacer
from workers.serving.requests import TokenLogprob


@dataclass
class _Placed:
    entry: TokenLogprob
    at: Placement


class AlignedLogprobs:
    """push(delta) -> the (entry, text offset) pairs whose text has now been sent, in order."""

    def __init__(self, pieces: TokenPieces, skip_special_tokens: bool = True, prompt_ids=()) -> None:
        """skip_special_tokens: as the response's text is decoded (the request's skip_special_tokens).
        prompt_ids: the prompt the response's text was primed with (TextStream's), so the tokens are
        placed in the same text (a SentencePiece first token's space)."""
        self._placer = TokenPlacer(pieces, skip_special_tokens, prompt_ids)
        self._waiting: deque[_Placed] = deque()
        self._sent_bytes = 0

    def push(self, delta: StreamDelta) -> list[tuple[TokenLogprob, int]]:
        entries = list(delta.logprobs or ())
        if delta.finish_reason is not None and delta.stop_token_hidden and entries:  # set on the last delta only
            # the stop token that ended the request, whose text the text leaves out: the delta's
            # last token, never placed or sent; usage still counts it
            entries.pop()
        for entry in entries:
            self._waiting.append(_Placed(entry, self._placer.place(entry.token_id)))
        self._sent_bytes += len(delta.text.encode())
        if delta.finish_reason is not None:
            # The end: everything the text holds is sent. Past a stop string's cut lie only the stop
            # string's tokens; otherwise what is left starts at the very end (a special token that
            # decodes to nothing, the last bytes of an unfinished character) and belongs to the text.
            ready = [p for p in self._waiting if not delta.stopped_by_string or self._before_the_cut(p)]
            self._waiting.clear()
            return [(p.entry, p.at.offset) for p in ready]
        ready = []
        while self._waiting and self._waiting[0].at.start_byte < self._sent_bytes:
            ready.append(self._waiting.popleft())
        return [(p.entry, p.at.offset) for p in ready]

    def _before_the_cut(self, placed: _Placed) -> bool:
        at = placed.at
        return at.start_byte < self._sent_bytes or (at.start_byte == self._sent_bytes and not at.adds_bytes)
