"""The leader's held tokens (workers/serving/held_tokens.py) and how the driver reads an event that
gathered several (launcher/serving/text_stream.py): a stream_interval changes when tokens arrive,
never which ones, their text, their log-probabilities or where a stop string ends the request."""

from __future__ import annotations

import random

import pytest

from launcher.serving.text_stream import TextStream
from workers.serving.held_tokens import MOST_HELD, HeldTokens, held_per_event, join
from workers.serving.requests import TokenEvent, TokenLogprob


def token_event(token: int, finish: str | None = None, at_s: float = 0.0, **fields) -> TokenEvent:
    return TokenEvent("r", [token], finish, [TokenLogprob(token, -0.1 * token)], at_s=at_s, **fields)


def gathered(events: list[TokenEvent], interval: int, held: HeldTokens | None = None) -> list[TokenEvent]:
    """The events a leader posts for `events` (one token each, the first being the submission's
    first token) at stream_interval `interval`."""
    held, out = held if held is not None else HeldTokens(), []
    for i, event in enumerate(events):
        out.extend(held.pass_on(event, interval, first=i == 0))
    return out


@pytest.mark.parametrize("interval, count, expected", [
    (1, 4, [[0], [1], [2], [3]]),
    (3, 8, [[0], [1, 2, 3], [4, 5, 6], [7]]),  # the end goes at once with what was held
    (3, 7, [[0], [1, 2, 3], [4, 5, 6]]),
    (4, 1, [[0]]),
    (100, 5, [[0], [1, 2, 3, 4]]),
])
def test_the_first_token_goes_at_once_then_every_interval_and_the_end_with_what_was_held(interval, count, expected):
    held = HeldTokens()
    events = [token_event(t, "length" if t == count - 1 else None) for t in range(count)]
    assert [e.token_ids for e in gathered(events, interval, held)] == expected
    assert len(held) == 0


def test_a_joined_event_keeps_every_tokens_logprobs_the_last_time_and_the_first_tokens_extras():
    first = token_event(1, at_s=1.0, prompt_logprobs=[TokenLogprob(9, -1.0)], cached_tokens=16)
    first.logits = ["l1"]
    second = token_event(2, "stop", at_s=2.0)
    second.logits = ["l2"]
    both = join(first, second)
    assert both.token_ids == [1, 2] and [p.token_id for p in both.logprobs] == [1, 2]
    assert both.logits == ["l1", "l2"] and both.at_s == 2.0 and both.finish_reason == "stop"
    assert both.prompt_logprobs == first.prompt_logprobs and both.cached_tokens == 16
    plain = join(TokenEvent("r", [1]), TokenEvent("r", [2]))
    assert plain.logprobs is None and plain.logits is None


def test_an_error_passes_the_held_tokens_on_first_and_a_cancel_forgets_them():
    held = HeldTokens()
    assert held.pass_on(token_event(0), 4, first=True)[0].token_ids == [0]
    assert held.pass_on(token_event(1), 4, False) == [] and held.pass_on(token_event(2), 4, False) == []
    failed = held.failed(TokenEvent("r", [], "error", error="grammar"))
    assert [(e.token_ids, e.finish_reason) for e in failed] == [([1, 2], None), ([], "error")]
    assert held.pass_on(token_event(3), 4, False) == [] and len(held) == 1
    held.drop("r")
    assert len(held) == 0
    assert held.pass_on(token_event(4), 4, False) == []
    held.clear()
    assert len(held) == 0


def test_requests_are_held_apart():
    held = HeldTokens()
    a, b = TokenEvent("a", [1]), TokenEvent("b", [2])
    assert held.pass_on(a, 2, False) == [] and held.pass_on(b, 2, False) == []
    assert [e.token_ids for e in held.pass_on(TokenEvent("a", [3]), 2, False)] == [[1, 3]]
    assert [e.finish_reason for e in held.failed(TokenEvent("a", [], "error", error="x"))] == ["error"]
    assert len(held) == 1


def read_to_the_end(stream: TextStream, events: list[TokenEvent]) -> list:
    """Deltas up to the one that ends the request, as a reader takes them."""
    deltas = []
    for event in events:
        deltas.append(stream.delta(event))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


@pytest.mark.parametrize("seed", range(12))
def test_gathered_events_read_as_one_event_per_token(smollm2_tokenizer, seed):
    """Random texts, stop strings, min_tokens and intervals: the text, tokens, log-probabilities,
    count and finish the reader ends with are those of one event per token."""
    rng = random.Random(seed)
    words = ["zero", "one", "two", "three", " é", "日本", "\n", "!"]
    ids = smollm2_tokenizer("".join(rng.choice(words) + " " for _ in range(12)), add_special_tokens=False)["input_ids"]
    pieces = [smollm2_tokenizer.decode(ids[i:i + 2]) for i in range(0, len(ids) - 1, 3)]
    stops = tuple(rng.sample(pieces, 2)) if rng.random() < 0.8 else ()
    options = dict(min_tokens=rng.choice([0, 0, 3]), include_stop_str_in_output=rng.random() < 0.3)

    def events():  # each reading its own: the holder extends the events it holds
        return [token_event(t, "length" if i == len(ids) - 1 else None, at_s=float(i)) for i, t in enumerate(ids)]

    alone = read_to_the_end(TextStream("r", smollm2_tokenizer, stops, 1, **options), events())
    together = read_to_the_end(TextStream("r", smollm2_tokenizer, stops, 1, **options), gathered(events(), rng.choice([2, 3, 5])))

    def summary(deltas):
        return ("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                [p.token_id for d in deltas for p in d.logprobs or []], deltas[-1].completion_tokens,
                deltas[-1].finish_reason, deltas[-1].stopped_by_string)

    assert summary(together) == summary(alone)
    assert len(together) < len(alone) or len(alone) <= 2  # they did arrive gathered


def test_past_what_a_leader_holds_it_holds_a_divisor_of_the_interval_where_one_is_large_enough():
    """So that its events end where the reader's deltas do; a prime interval, or one whose divisors
    are all below half of MOST_HELD (each would wake the replica more often), gets MOST_HELD."""
    assert [held_per_event(n) for n in (1, 8, MOST_HELD)] == [1, 8, MOST_HELD]
    assert [held_per_event(n) for n in (100, 128, 195, 3 * MOST_HELD)] == [50, MOST_HELD, 39, MOST_HELD]
    assert [held_per_event(n) for n in (67, 101, 193, 13 * 17, 85)] == [MOST_HELD] * 5
