"""What a group's leader receives (StreamRequest) and what it hands back (TokenEvent).

Both cross the Ray boundary between the driver and rank 0, so they hold plain Python values only
(no tensors but the optional logits, which only accuracy checks ask for)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlib.sampling_params import SamplingParams

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (the OpenAI API's own bound)."""


@dataclass(frozen=True)
class StreamRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    """The whole history to prefill: the prompt, plus the tokens already streamed when a request is
    resumed after its group was restarted."""
    sampling: SamplingParams
    max_tokens: int
    """New tokens to generate at most (after prompt_token_ids)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after one of these (EOS included unless the caller ignores it)."""
    logprobs: int | None = None
    """None: no log-probabilities; n >= 0: the chosen token's plus the n most likely (n <= MAX_LOGPROBS)."""
    return_logits: bool = False
    """Send the full logits each token was chosen from (accuracy checks)."""
    prompt_logprobs: int | None = None
    """None: none; n >= 0: the log-probability of every prompt token after the first (given the
    tokens before it) plus the n most likely at its place, sent with the first generated token
    (workers/serving/prompt_scoring.py). A resumed request that delivered a token has sent them."""
    draws_before: int = 0
    """Tokens this request chose before this submission (a resumed request's delivered tokens):
    its draws are numbered on from there, so a seeded stream resumed after a fault goes on drawing
    what it would have drawn (workers/serving/token_choice.py)."""
    cache_salt: str | None = None
    """Prefix caching (workers/serving/prefix_reuse.py) shares cached prefixes only between requests
    of the same salt; None is a group of its own (the requests that sent none). vLLM's cache_salt:
    clients that distrust each other each send a secret one, so none can time another's prompts."""
    stream_interval: int = 1
    """Tokens the leader gathers into one event (vLLM's stream_interval): the first token of each
    submission goes at once, the later ones every stream_interval tokens, and whatever is held goes
    with the request's end (workers/serving/held_tokens.py). 1: every token as it is chosen."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """The n most likely (token id, logprob) pairs at this position, most likely first."""
    rank: int | None = None
    """A prompt token's place among the vocabulary at its position (1: the most likely; equal ones
    share the best place), as vLLM's prompt_logprobs report it; None for generated tokens."""


@dataclass
class TokenEvent:
    """New tokens of one request, in order; the last event of a request has finish_reason set."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; "stop" (a stop token), "length" (max_tokens), "abort" (cancelled), "error"
    (this request alone failed: `error` says why; the group serves on)."""
    logprobs: list[TokenLogprob] | None = None
    logits: list | None = None
    """With return_logits: one (vocab,) float32 tensor per token."""
    at_s: float = 0.0
    """Rank 0's time.perf_counter() once the step that produced these tokens (the last of them, when
    the request's stream_interval gathered several) had chosen them: the gaps
    between one request's events are its inter-token times on the leader's clock (planning, the
    step's every forward and token choice included), comparable between the requests of one group."""
    error: str | None = None
    """With finish_reason "error": what failed."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """On the request's first token's event, when it asked for prompt_logprobs: one entry per prompt
    token after the first, in order."""
    cached_tokens: int | None = None
    """On the first token's event of each submission: the prompt tokens the cache held (in its row,
    or copied into it from another: prefix caching), which were not prefilled again."""
