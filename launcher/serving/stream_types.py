"""What Launcher.stream / astream yield."""

from __future__ import annotations

from dataclasses import dataclass

from workers.serving.requests import TokenLogprob


@dataclass
class StreamDelta:
    request_id: str
    text: str
    """Text new since the previous delta; never ends inside a multi-byte character, and never
    includes a stop string (text that might start one is held back until it cannot), except the one
    that ends the text when the request asked for include_stop_str_in_output."""
    token_ids: list[int]
    """Tokens new since the previous delta (a delta may carry text of earlier tokens)."""
    finish_reason: str | None = None
    """Set on the last delta only: "stop" (stop token or stop string), "length" (max_new_tokens)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Tokens generated so far, this delta's included."""
    logprobs: list[TokenLogprob] | None = None
    """One entry per token of token_ids, when the request asked for logprobs."""
    time_to_first_token_s: float | None = None
    """On the delta that carries the first token: seconds since the request was submitted."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """On the delta that carries the first token, when the request asked for prompt_logprobs: one
    entry per prompt token but the first (whose probability nothing before it conditions), in order."""
    stopped_by_string: bool = False
    """On the last delta when a stop string ended the text (finish_reason is then "stop"): the
    tokens that spelled it are in token_ids and logprobs, but none of their text is (with
    include_stop_str_in_output the text ends with it instead)."""
    cached_tokens: int | None = None
    """On the delta that carries the first token: the prompt tokens whose keys and values the cache
    held (in the request's row, or copied into it from another: prefix caching), so they were not
    prefilled."""
    parts: list[StreamDelta] | None = None
    """On a delta that gathered several tokens (stream_interval): the deltas of one token each that it
    joins, in order, as they would have come one by one, for readers that need each token's text by
    itself (where a thinking ended, say); None on a delta of at most one token."""
    stop_reason: str | int | None = None
    """On the last delta, what ended a "stop": the stop string that matched, or the stop token id that
    ended the text (one of the request's stop token ids, or an end token other than the tokenizer's
    own EOS); None for the tokenizer's EOS, for a structured output's end, for "length", and on every
    other delta. The OpenAI routes send it as the choice's stop_reason."""
    stop_token_hidden: bool = False
    """On the last delta when the stop token that ended the request (an EOS, one of its stop token
    ids) is left out of the text (TextStream: unless include_stop_str_in_output): it is the last of
    token_ids and of logprobs, and counted in completion_tokens, but none of its text is sent, so
    its log-probability is not either (launcher/serving/logprob_alignment.py)."""
