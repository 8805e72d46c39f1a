"""The prompt a completions request echoes (`echo: true`): its text comes before the completion's
in the choice's text, and with `logprobs` its tokens come first in the logprobs object.

The text is the prompt as sent when it was text (OpenAI's echo gives it back as it was), else the
prompt's token ids decoded (launcher/serving/detokenizer.py) with their special tokens: a control
token a completions prompt holds is read as that token, and comes back as its text either way. The
prompt tokens' `text_offset`s count the characters of that decoding, token by token; the
completion's offsets are moved on by the echoed text's length, so each offset points into the
choice's text. (For a text prompt the two agree where the tokenizer gives the text back as it was
sent, as byte-level BPE tokenizers do; one that normalizes it, or adds a space, shifts the
prompt's offsets.) The completion is decoded on its own, as without echo: a token-id prompt that
ends inside a character echoes that character's bytes as U+FFFD, and bytes of it the completion
brings are U+FFFD too.
The first prompt token has no log-probability (nothing before it conditions it): its
`token_logprobs` and `top_logprobs` entries are null, as OpenAI's are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.serving import openai_protocol as proto
from launcher.serving.token_pieces import TextOffsets, TokenPieces


@dataclass(frozen=True)
class EchoedPrompt:
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[int, ...] | None = None
    """Each prompt token's offset into the decoded prompt (None: no logprobs asked)."""


def echoed_prompt(pieces: TokenPieces, sent: str | list[int], token_ids: list[int], with_logprobs: bool) -> EchoedPrompt:
    """The prompt to echo, from the prompt as sent and its token ids (on a thread: a long prompt's
    offsets take a decode per token)."""
    offsets = None
    if with_logprobs or not isinstance(sent, str):
        placing = TextOffsets(pieces.tokenizer, skip_special_tokens=False)
        placed = [placing.place(t) for t in token_ids]
        offsets = tuple(offset for offset, _ in placed)
        decoded = "".join(text for _, text in placed) + placing.flush()
    text = sent if isinstance(sent, str) else decoded
    return EchoedPrompt(text, tuple(token_ids), offsets if with_logprobs else None)


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
