"""From the engine's stream deltas to the OpenAI objects of one response: streamed chunks, or the
whole response once the stream ends. One renderer per choice of a request (`n`; each renders its
`index`); pure (a tokenizer is only asked for the
text and bytes of single tokens, for log-probabilities: launcher/serving/token_pieces.py). A
token's log-probability goes out with the text that holds it, never before it, and not at all for
the tokens of a stop string (launcher/serving/logprob_alignment.py)."""

from __future__ import annotations

from launcher.serving import openai_protocol as proto
from launcher.serving.logprob_alignment import AlignedLogprobs
from launcher.serving.token_pieces import TokenPieces


class CompletionRender:
    """/v1/completions objects from the engine's deltas."""

    id_prefix, chunk_object, response_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, pieces: TokenPieces, logprobs: bool, index: int = 0):
        self.pieces, self.aligned = pieces, AlignedLogprobs(pieces)
        self.logprobs, self.index = logprobs, index
        self.text, self.logprob_parts = [], []

    def _logprobs(self, delta) -> dict | None:
        if not self.logprobs:
            return None
        ready = self.aligned.push(delta)
        return proto.completion_logprobs(ready, self.pieces) if ready else None

    def opening(self, meta) -> list[dict]:
        return []

    def chunk(self, meta, delta) -> dict | None:
        logprobs = self._logprobs(delta)
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None  # tokens whose text is held back (a possible stop string, a partial character)
        return proto.completion_chunk(meta, delta.text, delta.finish_reason, logprobs, self.index)

    def collect(self, delta) -> None:
        self.text.append(delta.text)
        part = self._logprobs(delta)
        if part is not None:
            self.logprob_parts.append(part)

    def choice(self, finish) -> dict:
        logprobs = proto.merge_completion_logprobs(self.logprob_parts) if self.logprobs else None
        return proto.completion_choice("".join(self.text), finish, logprobs, self.index)

    def response(self, meta, finish, usage) -> dict:
        return proto.response(meta, self.response_object, [self.choice(finish)], usage)


class ChatRender:
    """/v1/chat/completions objects from the engine's deltas."""

    id_prefix, chunk_object, response_object = "chatcmpl", "chat.completion.chunk", "chat.completion"

    def __init__(self, pieces: TokenPieces, logprobs: bool, index: int = 0):
        self.pieces, self.aligned = pieces, AlignedLogprobs(pieces)
        self.logprobs, self.index = logprobs, index
        self.text, self.entries = [], []

    def _ready(self, delta) -> list:
        return [entry for entry, _ in self.aligned.push(delta)] if self.logprobs else []

    def opening(self, meta) -> list[dict]:
        return [proto.chat_chunk(meta, {"role": "assistant", "content": ""}, index=self.index)]

    def chunk(self, meta, delta) -> dict | None:
        ready = self._ready(delta)
        logprobs = proto.chat_logprobs(ready, self.pieces) if ready else None
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        return proto.chat_chunk(meta, {"content": delta.text} if delta.text else {}, delta.finish_reason, logprobs,
                                self.index)

    def collect(self, delta) -> None:
        self.text.append(delta.text)
        self.entries.extend(self._ready(delta))

    def choice(self, finish) -> dict:
        logprobs = proto.chat_logprobs(self.entries, self.pieces) if self.logprobs else None
        return proto.chat_choice("".join(self.text), finish, logprobs, self.index)

    def response(self, meta, finish, usage) -> dict:
        return proto.response(meta, self.response_object, [self.choice(finish)], usage)
