"""The serving loop's leader at its edges (in-process): a request too long for a cache row is refused
alone at submission while the others go on, and structured requests that waited for the grammar
tokenizer start as soon as it is ready, not at the idle leader's next heartbeat."""

from __future__ import annotations

import threading
import time

import pytest

from tests.model_factory import build_random_model
from tests.serving_driver import collect, request, run_loops, stop
from tests.test_engine import fresh_model
from workers.serving import loop as loop_module
from workers.serving.loop import ServingConfig, ServingLoop

SLOTS = 64


def error_of(out, request_id: str) -> str:
    [error] = [e.error for e in out.events if e.request_id == request_id and e.finish_reason == "error"]
    return error


def test_a_request_too_long_for_a_cache_row_is_refused_alone_and_one_that_just_fits_runs():
    """Its decode wrote past its row (IndexError in the forwards), which ended the group's loop and
    every request on it. Refused at submission now; a request needs prompt + max_tokens - 1 slots
    (its last token is never fed back), so one needing all 64 runs to its length."""
    loop = ServingLoop(fresh_model(), ServingConfig(2, 8, SLOTS))
    threads = run_loops([loop])
    try:
        loop.submit([request("ok", [1, 2, 3], 20), request("long", range(1, 61), 10)])
        out = collect(loop, {"ok", "long"}, timeout_s=30)
        assert out.finish == {"ok": "length", "long": "error"} and len(out.tokens["ok"]) == 20
        assert not out.tokens["long"]
        assert error_of(out, "long") == (
            "the prompt has 60 tokens; with max_tokens 10 that needs 69 cache slots but each row of the serving "
            "cache holds 64 (cache_slots): shorten the prompt or lower max_tokens")
        loop.submit([request("fits", range(1, 61), 5), request("one more", range(1, 61), 6)])
        out = collect(loop, {"fits", "one more"}, timeout_s=30)
        assert out.finish == {"fits": "length", "one more": "error"} and len(out.tokens["fits"]) == 5
        assert "needs 65 cache slots but each row of the serving cache holds 64" in error_of(out, "one more")
    finally:
        stop([loop], threads)


def test_an_empty_prompt_or_one_outside_the_vocabulary_is_refused_alone():
    """An empty prompt that reached the loop never got a chunk nor a token to decode: it held its row
    for good (the next request never ran) and the leader spun on a full core. An id past the
    vocabulary ran, reading as no token, and answered noise. Each is refused alone now."""
    loop = ServingLoop(fresh_model(), ServingConfig(1, 8, SLOTS))
    vocab = loop.model.config.vocab_size
    threads = run_loops([loop])
    try:
        loop.submit([request("empty", (), 4), request("outside", (5, vocab), 3), request("negative", (-1, 5), 3),
                     request("next", (5, 9, 33), 3)])
        out = collect(loop, {"empty", "outside", "negative", "next"}, timeout_s=30)
        assert out.finish == {"empty": "error", "outside": "error", "negative": "error", "next": "length"}
        assert error_of(out, "empty") == "the prompt is empty (0 tokens): a request needs at least one prompt token"
        assert error_of(out, "outside") == (f"prompt token id {vocab} is outside the vocabulary (0 .. {vocab - 1}): "
                                            f"send ids the model's tokenizer gives")
        assert error_of(out, "negative").startswith("prompt token id -1 is outside the vocabulary")
        assert len(out.tokens["next"]) == 3
    finally:
        stop([loop], threads)


# ---- the grammar tokenizer's readiness wakes an idle leader --------------------------------------
@pytest.fixture(scope="module")
def structured_parts():
    pytest.importorskip("llguidance")
    from tests import test_structured_output as structured

    return structured


def test_the_grammar_tokenizer_calls_back_once_ready_and_reads_ready_in_the_callback(smollm2_tokenizer,
                                                                                     structured_parts):
    """The callback runs on the build's thread, still alive then: ready() must say True there, or a
    leader the callback woke would find the tokenizer pending and sleep a heartbeat again."""
    from workers.structured.matchers import GrammarTokenizer

    release = threading.Event()
    grammars = GrammarTokenizer(lambda: release.wait(60) and smollm2_tokenizer, structured_parts.VOCAB)
    seen, called = [], threading.Event()

    def on_ready() -> None:
        seen.append(grammars.ready())
        called.set()

    grammars.ready()  # starts the build, which waits for `release`
    grammars.when_ready(on_ready)
    assert not called.wait(0.2) and not seen  # not before the build ends
    release.set()
    assert called.wait(60) and seen == [True]
    late = []
    grammars.when_ready(lambda: late.append(grammars.ready()))  # once built: at once, on this thread
    assert late == [True] and seen == [True]


def test_a_structured_request_starts_once_the_tokenizer_is_ready_not_at_the_next_heartbeat(
        smollm2_tokenizer, structured_parts, monkeypatch):
    """An idle leader blocks on its inbox for HEARTBEAT_S; nothing woke it when the tokenizer came
    ready. With a 30 s heartbeat, the request starting within 10 s of the tokenizer's readiness can
    only be the wake-up's doing (it started 30 s after its submission)."""
    from workers.structured.matchers import GrammarTokenizer

    heartbeat_s = 30.0
    monkeypatch.setattr(loop_module, "HEARTBEAT_S", heartbeat_s)
    release = threading.Event()
    grammars = GrammarTokenizer(lambda: release.wait(60) and smollm2_tokenizer, structured_parts.VOCAB)
    hf = build_random_model("llama", seed=3, vocab_size=structured_parts.VOCAB)
    loop = structured_parts.fresh_loop(hf, smollm2_tokenizer, grammar_tokenizer=grammars)
    prompt = smollm2_tokenizer.encode("Hi")
    threads = run_loops([loop])
    try:
        loop.submit([structured_parts.structured("s", prompt, structured_parts.KINDS["choice"])])
        time.sleep(0.5)  # the leader has taken it, found the tokenizer building, and gone idle
        assert loop._awaiting_grammar and not grammars.ready()
        release.set()
        while not grammars.ready():
            time.sleep(0.005)
        ready_at = time.monotonic()
        out = collect(loop, {"s"}, timeout_s=heartbeat_s / 3)
        assert out.finish == {"s": "stop"} and time.monotonic() - ready_at < heartbeat_s / 3
    finally:
        release.set()
        stop([loop], threads)
