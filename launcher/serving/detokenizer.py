"""Text from a stream of token ids, one delta at a time, never ending inside a character.

A byte-level BPE token can carry part of a UTF-8 character (an emoji is often three or four
tokens), so decoding tokens one by one gives U+FFFD halves. Decoding everything each step is
correct but costs O(length) per token. The sliding window used by vLLM and TGI does neither:
decode only the tokens from `prefix_offset` on, twice per push:

    ids:   ... | prefix_offset ... read_offset | read_offset ... end |
                 already emitted (context)       not yet emitted

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

The context tokens are decoded again so that whatever depends on the neighbouring tokens (a
character split across the boundary) comes out the same as in the full decode. While `new_text`
ends in U+FFFD the last character is incomplete: nothing is emitted and the offsets stay, so the
next push decodes the held tokens again together with the new ones. Once the delta is complete
the window moves forward: the emitted tokens become the next context.

Why the concatenation equals the full decode: the window only moves to a point where its decode
ended in a complete character, and UTF-8 decoding restarts cleanly after a complete character, so
decoding from there gives the same characters as decoding from the start. One exception, only for
bytes the model never completes into a character: SentencePiece's byte-fallback decoder replaces
every byte of a run of byte tokens that is not valid UTF-8, valid ones included, so `<0x41><0x9F>`
decodes whole as two U+FFFD while the stream, which emitted "A" before the 0x9F came, has "A" and
one U+FFFD (byte-level BPE replaces only the invalid bytes, as the stream does). Such a run that
crosses the window's read point is replaced whole in `new_text`, the context's complete characters
included, so `prefix_text` is no prefix of it: the delta is then the held tokens decoded alone (one
U+FFFD per dangling byte), not `new_text` cut at the context's length, which gave a U+FFFD for
every byte of the context too ("中文" and two dangling bytes streamed as "中文" and four).

Decoded without the tokenizer's clean-up of spaces (`clean_up_tokenization_spaces`): it joins text
across tokens (" ' " to "'", " ." to "."), which a window cannot see whole, so a WordPiece stream
read "ß ' w" where its full decode read "ß'w". generate()'s text is decoded the same way.

Primed with the prompt (vLLM's FastIncrementalDetokenizer does the same): the prompt's last few
tokens (`prompt_context`) are pushed first and their text dropped, so the first generated token
is decoded as the full decode of prompt and completion reads it. Without them a SentencePiece
decoder (Llama 2, Mistral: Metaspace or Strip) strips the first token's space, so "▁Paris" after
"The capital is" came out "Paris": the echoed prompt and the completion ran together, and a stop
string " Paris" never matched it. Byte-level BPE decodes a token the same whatever precedes it, so
there the text is unchanged, except where the prompt ends inside a character: its bytes are held
like any unfinished character, and the generated token that completes it brings the whole
character out first in the completion's text (as vLLM's does), not U+FFFD halves.

Cost: a push decodes the context plus the held tokens, a handful for real text (an incomplete
character spans at most 3 byte tokens). Only output that keeps ending in invalid bytes (a trailing
U+FFFD that no later token completes) makes the held part grow, and the pushes slower, until a
push ends in a whole character again; the text stays exact.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""

PROMPT_CONTEXT_TOKENS = (4, 24)
"""The fewest and the most prompt tokens a stream is primed with (vLLM's)."""


def decode_text(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    """Generated token ids as text, as a stream's deltas add up to: no clean-up of spaces across
    tokens (module docstring)."""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def decode_after_prompt(tokenizer, ids, prompt_ids=(), skip_special_tokens: bool = True) -> str:
    """Generated token ids as text, decoded after the prompt's last tokens as a stream is primed
    (generate()'s text: a SentencePiece first token keeps its space there too). All ids are pushed
    at once, so it equals the stream's text only where decoding in one piece and token by token
    agree: with a byte-fallback tokenizer (Llama 2, Mistral) a run of byte tokens that is not valid
    UTF-8 decodes here as one U+FFFD per byte of the whole run, while the stream has already sent
    the run's complete characters and replaces only the dangling bytes (README, Text)."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
    return detokenizer.push(list(ids)) + detokenizer.flush()


def prompt_context(tokenizer, prompt_ids, skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last few ids a stream is primed with (vLLM's choice): the fewest, from 4 on,
    whose decode holds no U+FFFD (they start on a character, and a byte-fallback run is not cut
    into), else the last 24 (a prompt that ends inside a character: its bytes are held). vLLM takes
    the whole prompt there; 24 keeps the priming a few decodes whatever the prompt's length."""
    ids = list(prompt_ids)
    fewest, most = PROMPT_CONTEXT_TOKENS
    for n in range(fewest, min(len(ids), most) + 1):
        if REPLACEMENT_CHAR not in decode_text(tokenizer, ids[-n:], skip_special_tokens):
            return ids[-n:]
    return ids[-most:]


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas; each push decodes only the last few tokens.

    `tokenizer` is a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
    `prompt_ids`: the request's prompt, whose last few tokens are decoded as left context of the
    first generated token and never emitted (module docstring). Without them the first generated
    token is decoded as `tokenizer.decode(generated_ids)` decodes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids=()):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        """Start of the window: tokens before it are decoded and emitted for good."""
        self._read_offset = 0
        """Tokens before this have been emitted; from here on they are pending."""
        self._pieces: list[str] = []
        self.context = prompt_context(tokenizer, prompt_ids, skip_special_tokens) if len(prompt_ids) else []
        """The prompt's ids it was primed with."""
        for token in self.context:  # one at a time, as generated tokens come: the window ends where they would leave it
            self.push([token])
        self._pieces.clear()

    @property
    def held_context(self) -> list[int]:
        """The prompt's last tokens still held (a character the prompt ends inside): the first
        generated text starts with their character."""
        return self._ids[self._read_offset:len(self.context)]

    @property
    def text(self) -> str:
        """Everything emitted so far (pushes and flush)."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens pushed (the prompt's context not counted)."""
        return self._ids[len(self.context):]

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens; returns only the text that is new and complete (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        # A trailing U+FFFD is an unfinished character: hold it (and the tokens that carry it)
        # until the next push completes it. `len(new_text) > len(prefix_text)`: tokens that decode
        # to nothing (skipped special tokens) emit nothing and keep the window where it is.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(self._delta(prefix_text, new_text))

    def flush(self) -> str:
        """The text still held back when the request ends (may end in U+FFFD if the generation
        stopped inside a character, exactly as the full decode does)."""
        if self._read_offset == len(self._ids) or len(self._ids) == len(self.context):
            return ""  # nothing held, or only the prompt's bytes: they are no generated text
        prefix_text, new_text = self._decode_window()
        return self._emit(self._delta(prefix_text, new_text))

    def _delta(self, prefix_text: str, new_text: str) -> str:
        if new_text.startswith(prefix_text):
            return new_text[len(prefix_text):]
        # a byte-fallback run across the read point, replaced whole (module docstring): the held tokens alone
        return self._decode(self._ids[self._read_offset:])

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        context = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:context]) if context else ""
        return prefix_text, self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self._tokenizer, ids, self._skip_special_tokens)

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta
