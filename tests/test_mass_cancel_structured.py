"""Cancelling structured requests that wait for the grammar tokenizer or their matcher builds
compares ids a number of times linear in the cancels (as the scheduler's queue does since 02eb836),
not cancels x waiting: 8,000 building requests cancelled at once held the leader 56 s without a plan
(its followers wait for the next plan only --rendezvous-timeout, 30 s by default). Kept by id, a
second submit of a waiting id must not replace the first: it is answered "abort", as the queue does."""

from __future__ import annotations

import threading

import pytest

from shardlib.sampling_params import SamplingParams
from shardlib.structured_output import StructuredOutput
from tests.serving_driver import request
from tests.test_engine import fresh_model
from workers.serving.loop import ServingConfig, ServingLoop
from workers.structured.matchers import GrammarTokenizer

WAITING, CANCELLED = 500, 50


class CountedId(str):
    comparisons = 0

    def __eq__(self, other):
        CountedId.comparisons += 1
        return str.__eq__(self, other)

    def __ne__(self, other):
        CountedId.comparisons += 1
        return str.__ne__(self, other)

    __hash__ = str.__hash__


SPEC = SamplingParams(structured_output=StructuredOutput(choice=["yes", "no"]))


def held_loop(where: str, release: threading.Event) -> ServingLoop:
    """A loop whose structured requests wait, until `release`, for the grammar tokenizer or (where
    "build") each for its matcher's build, standing in for a schema slow to compile."""
    loop = ServingLoop(fresh_model(), ServingConfig(4, 64, 64),
                       grammar_tokenizer=GrammarTokenizer(lambda: release.wait(60) and None, 128))
    if where == "build":
        loop._grammar_pending = lambda: False
        loop._grammar = lambda request: release.wait(60)
    return loop


@pytest.mark.parametrize("where", ["tokenizer", "build"])
def test_cancelling_waiting_structured_requests_is_linear_in_the_cancels(where):
    release = threading.Event()
    loop = held_loop(where, release)
    spec = SPEC
    ids = [CountedId(f"s{i}") for i in range(WAITING)]
    try:
        events = []
        loop._apply(("submit", [request(rid, [5, 9], 4, sampling=spec) for rid in ids]), events)
        assert len(loop._awaiting_grammar) + len(loop._building) == WAITING and not events
        CountedId.comparisons = 0
        loop._apply(("cancel", [CountedId(str(rid)) for rid in ids[-CANCELLED:]]), events)
        assert [e.finish_reason for e in events] == ["abort"] * CANCELLED
        assert CountedId.comparisons <= 4 * CANCELLED, f"{CANCELLED} cancels compared ids {CountedId.comparisons} times"
    finally:
        release.set()


@pytest.mark.parametrize("where", ["tokenizer", "build"])
def test_a_second_submit_of_a_waiting_id_is_aborted_and_the_first_kept(where):
    release = threading.Event()
    loop = held_loop(where, release)
    try:
        events = []
        first = request("same", [5, 9], 4, sampling=SPEC)
        loop._apply(("submit", [first]), events)
        loop._apply(("submit", [request("same", [7], 2, sampling=SPEC)]), events)
        assert [(e.request_id, e.finish_reason) for e in events] == [("same", "abort")]
        waiting = loop._awaiting_grammar.get("same") or loop._building["same"][0]
        assert waiting.request is first
    finally:
        release.set()
