"""Tokens a group's leader holds back, so that each event of a request carries stream_interval tokens.

Why on the leader, not where the text is sent: every event the leader posts wakes its sender thread,
the driver's reader and, over HTTP, the replica's stream and the client, and on a small machine each
wake-up takes CPU from the forward's own threads (README, Measured). Holding the tokens where they are
chosen saves all of those wake-ups, not only the last one (vLLM holds them in its API process).

What holding costs: a held token reaches the reader up to stream_interval - 1 steps later. A request
with stop strings is never held (the driver matches them on each token, and its stream gathers the
tokens instead: Launcher._new_stream, launcher/serving/request_streams.py). Tokens
still held when the group fails were never delivered: the resumed request generates those positions
again (launcher/cluster/stream_handle.py), so none is lost or sent twice.
"""

from __future__ import annotations

from workers.serving.requests import TokenEvent

MOST_HELD = 64
"""The most tokens a leader holds for one request: a larger stream_interval is gathered on by the
driver's stream (Launcher._new_stream), as one with stop strings is. It bounds what a group fault
makes a resumed request generate again (the tokens held, never delivered) and what one event
carries to the reader at once (a 16,000-token event held a replica's event loop 0.44 s)."""


def held_per_event(stream_interval: int) -> int:
    """The interval a leader holds a stream's tokens by for a reader asking stream_interval: that
    interval, up to MOST_HELD; past it, its largest divisor from MOST_HELD / 2 to MOST_HELD, so
    that the leader's events end where the reader's deltas do (a delta complete inside an event
    waited for the event's end: up to MOST_HELD - 1 steps), else MOST_HELD. Not below half of
    MOST_HELD: a whole answer on a server whose interval is above it reads nothing until its end,
    and more events would only cost the replica more wake-ups."""
    if stream_interval <= MOST_HELD:
        return stream_interval
    return next((d for d in range(MOST_HELD, MOST_HELD // 2 - 1, -1) if stream_interval % d == 0), MOST_HELD)


def join(held: TokenEvent, later: TokenEvent) -> TokenEvent:
    """`held` (an event the holder owns) with `later`'s tokens added, in place, so that holding n
    tokens costs n appends, not n copies of what was held: the later one's end, error and time
    (at_s: when its last token was chosen); the first token's prompt log-probabilities and cached
    count stay."""
    held.token_ids.extend(later.token_ids)
    held.logprobs = _extended(held.logprobs, later.logprobs)
    held.logits = _extended(held.logits, later.logits)
    held.finish_reason, held.error, held.at_s = later.finish_reason, later.error, later.at_s
    if held.prompt_logprobs is None:
        held.prompt_logprobs = later.prompt_logprobs
    if held.cached_tokens is None:
        held.cached_tokens = later.cached_tokens
    return held


def _extended(first: list | None, second: list | None) -> list | None:
    if second is None:
        return first
    if first is None:
        return list(second)
    first.extend(second)
    return first


class HeldTokens:
    """The leader's held tokens, one event per request that has some. The events passed in are the
    holder's to change (the loop makes each for it)."""

    def __init__(self) -> None:
        self._held: dict[str, TokenEvent] = {}

    def __len__(self) -> int:
        return len(self._held)

    def pass_on(self, event: TokenEvent, interval: int, first: bool) -> list[TokenEvent]:
        """The events to post now for a token's `event`: it, after the tokens held for its request,
        once due (it ends the request, it is the submission's first token, or `interval` tokens have
        gathered); none while they are held. A request's interval never changes, so one of 1 never
        has any held."""
        if interval <= 1:
            return [event]
        held = self._held.pop(event.request_id, None)
        if held is not None:
            event = join(held, event)
        if event.finish_reason is None and not first and len(event.token_ids) < interval:
            self._held[event.request_id] = event
            return []
        return [event]

    def failed(self, error: TokenEvent) -> list[TokenEvent]:
        """The events to post for a request's `error` event: what was held first, as its own event
        (those tokens were chosen well, and a reader shows them before the error), then the error."""
        held = self._held.pop(error.request_id, None)
        return [error] if held is None else [held, error]

    def drop(self, request_id: str) -> None:
        """Forget a cancelled request's tokens: nobody reads them any more."""
        self._held.pop(request_id, None)

    def clear(self) -> None:
        self._held.clear()
