"""Log-probabilities kept in step with the response's text.

The engine sends each token's log-probability with the token, but the text can lag behind it: text
that may begin a stop string, or bytes of an unfinished character, are held back (StreamDelta.text).
A client reading a stream expects the tokens it is told about to be in the text it has, and a stop
string's tokens never to appear, as the stop string itself never does. So each entry waits here
until the emitted text reaches the token (its offset is before the end of the text sent so far),
and when a stop string ends the request the entries that start at or past the cut are dropped. A
token that straddles the cut (its text begins before the stop string) is kept: part of it was sent.
"""

from __future__ import annotations

from collections import deque

from launcher.serving.stream_types import StreamDelta
from launcher.serving.token_pieces import TextOffsets
from workers.serving.requests import TokenLogprob


class AlignedLogprobs:
    """push(delta) -> the (entry, text offset) pairs whose text has now been sent, in order."""

    def __init__(self, tokenizer) -> None:
        self._offsets = TextOffsets(tokenizer)
        self._waiting: deque[tuple[TokenLogprob, int]] = deque()
        self._sent_chars = 0

    def push(self, delta: StreamDelta) -> list[tuple[TokenLogprob, int]]:
        for entry in delta.logprobs or ():
            self._waiting.append((entry, self._offsets.next(entry.token_id)))
        self._sent_chars += len(delta.text)
        if delta.finish_reason is not None:
            # The end: everything the text holds is sent. Past a stop string's cut lie only the stop
            # string's tokens; otherwise what is left starts at the very end (a special token that
            # decodes to nothing, the last bytes of an unfinished character) and belongs to the text.
            ready = [(e, o) for e, o in self._waiting if not delta.stopped_by_string or o < self._sent_chars]
            self._waiting.clear()
            return ready
        ready = []
        while self._waiting and self._waiting[0][1] < self._sent_chars:
            ready.append(self._waiting.popleft())
        return ready
