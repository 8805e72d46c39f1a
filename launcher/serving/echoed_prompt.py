"""The prompt a completions request echoes (`echo: true`): its text comes before the completion's
in the choice's text, and with `logprobs` its tokens come first in the logprobs object.

The text is the prompt as sent when it was text (OpenAI's echo gives it back as it was), else the
prompt's token ids decoded (launcher/serving/detokenizer.py) with their special tokens: a control
token a completions prompt holds is read as that token, and comes back as its text either way. The
prompt tokens' `text_offset`s count the characters of that decoding, token by token; the
completion's offsets are moved on by the echoed text's length, so each offset points into the
choice's text. For a text prompt the decoding also holds the special tokens the tokenizer added
around it (Llama's, Mistral's, Gemma's BOS), which the echoed text (the prompt as sent) has not: the
offsets are moved back by what the decoding holds before the sent text, so they point into the
echoed text, and an added BOS's offset is 0 (it stands before the text; its token keeps its name).
(A tokenizer that normalizes the text, or adds a space, shifts the prompt's offsets.) The
completion is decoded after the prompt's last tokens, as without echo (launcher/serving/
detokenizer.py): a SentencePiece first token keeps its space (" Paris" after "The capital is"),
and a token-id prompt that ends inside a character echoes that character's bytes as U+FFFD while
the completion that completes it starts with the whole character (vLLM's rule).
The first prompt token has no log-probability (nothing before it conditions it): its
`token_logprobs` and `top_logprobs` entries are null, as OpenAI's are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.serving import openai_protocol as proto
from launcher.serving.token_pieces import TokenPieces, TokenPlacer


@dataclass(frozen=True)
class EchoedPrompt:
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[int, ...] | None = None
    """Each prompt token's offset into the echoed text (None: no logprobs asked)."""


def echoed_prompt(pieces: TokenPieces, sent: str | list[int], token_ids: list[int], with_logprobs: bool) -> EchoedPrompt:
    """The prompt to echo, from the prompt as sent and its token ids (on a thread: a long prompt's
    offsets take a decode per token)."""
    offsets = None
    if with_logprobs or not isinstance(sent, str):
        # placed as the completion's tokens are: a byte no token completes is its U+FFFD's place
        placing = TokenPlacer(pieces, skip_special_tokens=False)
        placed = [placing.place(t) for t in token_ids]
        offsets = tuple(at.offset for at in placed)
        decoded = "".join(at.text for at in placed) + placing.flush()
    if isinstance(sent, str) and with_logprobs:
        offsets = _into_sent_text(offsets, decoded, sent)
    text = sent if isinstance(sent, str) else decoded
    return EchoedPrompt(text, tuple(token_ids), offsets if with_logprobs else None)


def _into_sent_text(offsets: tuple[int, ...], decoded: str, sent: str) -> tuple[int, ...]:
    """Offsets into the decoding of a text prompt's ids moved into the text as sent: back by the
    characters of the special tokens the tokenizer added before it (a BOS), kept within the text
    (an added token before it is at 0, one after it, an EOS, at its end). A decoding that does not
    hold the sent text (a normalizing tokenizer) keeps its offsets."""
    if decoded.endswith(sent):
        lead = len(decoded) - len(sent)
    else:  # a token added after the text too
        lead = decoded.find(sent)
    if lead <= 0:
        return offsets
    return tuple(min(max(offset - lead, 0), len(sent)) for offset in offsets)


def prompt_logprobs(echo: EchoedPrompt, entries: list, pieces: TokenPieces, top_n: int | None = None) -> dict:
    """Completions' logprobs object for the echoed prompt: entries are the engine's TokenLogprob of
    every prompt token but the first, each listing its top_n most likely (the engine may have
    listed more, for vLLM's prompt_logprobs asked in the same request)."""
    first = {"tokens": [pieces.text(echo.token_ids[0])], "token_logprobs": [None], "top_logprobs": [None],
             "text_offset": [0]}
    if top_n is not None:
        entries = [replace(entry, top=entry.top[:top_n]) for entry in entries]
    rest = proto.completion_logprobs(list(zip(entries, echo.offsets[1:])), pieces)
    return proto.merge_completion_logprobs([first, rest])


def shifted(logprobs: dict | None, chars: int) -> dict | None:
    """A completion's logprobs object with its offsets moved on by the echoed text's length."""
    if logprobs is None or not chars:
        return logprobs
    return {**logprobs, "text_offset": [offset + chars for offset in logprobs["text_offset"]]}
