"""Tokens a group's leader holds back, so that each event of a request carries stream_interval tokens.

Why on the leader, not where the text is sent: every event the leader posts wakes its sender thread,
the driver's reader and, over HTTP, the replica's stream and the client, and on a small machine each
wake-up takes CPU from the forward's own threads (README, Measured). Holding the tokens where they are
chosen saves all of those wake-ups, not only the last one (vLLM holds them in its API process).

What holding costs: a held token reaches the reader up to stream_interval - 1 steps later, and a stop
string in it (the driver matches stop strings) ends the request that much later, so its row may run
those steps for nothing. Tokens still held when the group fails were never delivered: the resumed
request generates them again (launcher/cluster/stream_handle.py), so none is lost or sent twice.
"""

from __future__ import annotations

from workers.serving.requests import TokenEvent


def joined(earlier: TokenEvent, later: TokenEvent) -> TokenEvent:
    """One event of both events' tokens, in order; the later one's end, error and time (at_s: when its
    last token was chosen), the first token's prompt log-probabilities and cached count."""
    return TokenEvent(later.request_id, earlier.token_ids + later.token_ids, later.finish_reason,
                      _concatenated(earlier.logprobs, later.logprobs), _concatenated(earlier.logits, later.logits),
                      later.at_s, later.error,
                      earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs,
                      earlier.cached_tokens if earlier.cached_tokens is not None else later.cached_tokens)


def _concatenated(first: list | None, second: list | None) -> list | None:
    return None if first is None and second is None else (first or []) + (second or [])


class HeldTokens:
    """The leader's held tokens, one event per request that has some."""

    def __init__(self) -> None:
        self._held: dict[str, TokenEvent] = {}

    def __len__(self) -> int:
        return len(self._held)

    def pass_on(self, event: TokenEvent, interval: int = 1, first: bool = False) -> list[TokenEvent]:
        """The events to post now for `event`: it, after the tokens held for its request, once due
        (it ends the request, it is the submission's first token, or `interval` tokens have
        gathered); none while they are held. An error passes what was held on first, as its own
        event: those tokens were chosen well, and a reader shows them before the error."""
        held = self._held.pop(event.request_id, None)
        if held is None and interval <= 1:
            return [event]
        if event.finish_reason == "error":
            return [event] if held is None else [held, event]
        if held is not None:
            event = joined(held, event)
        if event.finish_reason is None and not first and len(event.token_ids) < interval:
            self._held[event.request_id] = event
            return []
        return [event]

    def drop(self, request_id: str) -> None:
        """Forget a cancelled request's tokens: nobody reads them any more."""
        self._held.pop(request_id, None)

    def clear(self) -> None:
        self._held.clear()
