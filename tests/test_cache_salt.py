"""Per-request cache_salt (vLLM's parameter): prefix caching shares a cached prefix only between
requests that sent the same salt (those that sent none are a group of their own), so clients of one
server cannot time each other's prompts. Checked at each layer: the rows' bookkeeping
(workers/serving/prefix_reuse.py), the scheduler (which also holds a request back only for a
prefill of its own salt), the serving loop with a real model, the driver API (refusals before
anything runs; a resumed stream keeps its salt) and the OpenAI request bodies."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving_driver import collect, request, run_loops, stop
from tests.test_engine import alone, fresh_model
from tests.test_replicas import EAGER, NEW_TOKENS, model_and_expected  # noqa: F401 - fixture
from workers.serving import prefix_reuse
from workers.serving.loop import ServingConfig, ServingLoop
from workers.serving.prefix_reuse import RowHistories, Seat
from workers.serving.scheduler import Scheduler, Sequence

SHARED = tuple((7 * i + 3) % 120 + 1 for i in range(40))
"""A 40-token prefix (more than MIN_SHARED_TOKENS), within the random test models' vocabulary."""


def cached_tokens(got, rid: str) -> int | None:
    values = [e.cached_tokens for e in got.events if e.request_id == rid and e.cached_tokens is not None]
    assert len(values) <= 1, f"{rid}: cached_tokens on {len(values)} events, expected the first token's only"
    return values[0] if values else None


# ---- the rows' bookkeeping and the scheduler (pure Python) -----------------------------------------
def test_a_free_row_is_shared_only_with_prompts_of_the_salt_that_left_it():
    assert len(SHARED) >= prefix_reuse.MIN_SHARED_TOKENS
    h = RowHistories()
    h.keep(0, SHARED, salt="a")
    h.keep(1, SHARED)  # no salt: shared with unsalted prompts only
    prompt = SHARED + (5,)
    assert h.choose([0, 1, 2], prompt, reuse=True, salt="a") == Seat(0, 40)
    assert h.choose([0, 1, 2], prompt, reuse=True) == Seat(1, 40)
    assert h.choose([0, 1, 2], prompt, reuse=True, salt="b") == Seat(2)  # nothing shared: the blank row
    # no blank row: another salt's row is written over (the one freed longest ago), nothing reused
    assert h.choose([0, 1], prompt, reuse=True, salt="b") == Seat(0)
    h.forget(0)
    h.keep(0, SHARED, salt="b")  # a row keeps the salt of the request that left it last
    assert h.choose([0, 1, 2], prompt, reuse=True, salt="b") == Seat(0, 40)
    assert h.choose([0, 2], prompt, reuse=True, salt="a") == Seat(2)


def test_a_running_rows_prefix_is_copied_only_for_a_prompt_of_its_salt():
    h = RowHistories()
    running = {0: ("a", SHARED + (1, 2)), 3: (None, SHARED[:20])}  # (cache_salt, token ids written)
    prompt = SHARED + (7,)
    assert h.choose([1, 2], prompt, reuse=True, in_use=running, salt="a") == Seat(1, 40, copy_from=0)
    assert h.choose([1, 2], prompt, reuse=True, in_use=running) == Seat(1, 20, copy_from=3)
    assert h.choose([1, 2], prompt, reuse=True, in_use=running, salt="b") == Seat(1)


@pytest.mark.parametrize("first_salt, second_salt, cached", [
    ("a", "a", 40), ("a", "b", 0), ("a", None, 0), (None, "a", 0), (None, None, 40),
], ids=["same-salt", "other-salt", "salted-then-unsalted", "unsalted-then-salted", "both-unsalted"])
def test_the_scheduler_reuses_a_finished_rows_prefix_only_for_the_same_salt(first_salt, second_salt, cached):
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=64, max_chunk=64, prefix_caching=True)
    sched.add(Sequence(request("first", SHARED + (1,), 4, cache_salt=first_salt)))
    sched.schedule()
    first = sched.running["first"]
    first.prefilled, first.generated, first.output_ids = 41, 1, [9]  # as the loop records them
    sched.finish(first)
    sched.add(Sequence(request("second", SHARED + (2,), 4, cache_salt=second_salt)))
    plan = sched.schedule()
    second = sched.running["second"]
    assert (second.cached, second.prefilled) == (cached, cached)
    assert [(c.start, len(c.token_ids)) for c in plan.prefills] == [(cached, 41 - cached)]


def test_a_request_waits_only_for_a_prefill_of_its_own_salt():
    """Three requests behind one 40-token prefix arrive while a salted one prefills it: the one of
    the same salt waits for that prefill and then copies it; another salt's, and an unsalted one,
    share nothing with it, so they are seated at once (held back, they would wait for nothing, and
    their delay would show the other client's prompt)."""
    sched = Scheduler(max_num_seqs=4, max_prefill_tokens=64, max_chunk=16, prefix_caching=True)
    sched.add(Sequence(request("a", SHARED + (1, 2), 4, cache_salt="x")))
    sched.add(Sequence(request("same", SHARED + (3,), 4, cache_salt="x")))
    sched.add(Sequence(request("other", SHARED + (4,), 4, cache_salt="y")))
    sched.add(Sequence(request("unsalted", SHARED + (5,), 4)))
    plan = sched.schedule()
    assert sorted(sched.running) == ["a", "other", "unsalted"]
    assert [s.request.request_id for s in sched.waiting] == ["same"]
    assert plan.copies == () and [sched.running[r].cached for r in ("other", "unsalted")] == [0, 0]
    a, other = sched.running["a"], sched.running["other"]
    a.prefilled, other.prefilled = 32, 40  # `other` wrote more of the prefix, but in another salt's request
    plan = sched.schedule()
    same = sched.running["same"]
    assert [(p.source, p.row, p.slots) for p in plan.copies] == [(a.row, same.row, 32)] and same.cached == 32


# ---- the serving loop with a real model ------------------------------------------------------------
def test_the_serving_loop_reuses_a_prefix_only_for_the_same_salt_and_tokens_are_unchanged():
    """Four requests behind one 40-token prefix, one after another (each row left free behind it):
    only the one of the first's salt reports cached tokens; every one's greedy tokens are its
    prompt's run alone through the static engine."""
    loop = ServingLoop(fresh_model(), ServingConfig(4, 64, 64, prefix_caching=True))
    threads = run_loops([loop])
    prompts = {"first": (SHARED + (1, 2), "a"), "other": (SHARED + (3,), "b"),
               "unsalted": (SHARED + (4,), None), "same": (SHARED + (5, 6), "a")}
    got = {}
    for rid, (prompt, salt) in prompts.items():
        loop.submit([request(rid, prompt, 5, cache_salt=salt)])
        got[rid] = collect(loop, {rid})
    stop([loop], threads)
    assert {rid: cached_tokens(g, rid) for rid, g in got.items()} == {"first": 0, "other": 0, "unsalted": 0,
                                                                      "same": 40}
    for rid, (prompt, _) in prompts.items():
        assert got[rid].tokens[rid] == alone(prompt, 5), rid


# ---- the driver API ----------------------------------------------------------------------------------
@pytest.fixture
def short_prefixes(monkeypatch):
    """Prefixes of any length are reused (the test prompts share fewer than MIN_SHARED_TOKENS)."""
    monkeypatch.setattr(prefix_reuse, "MIN_SHARED_TOKENS", 1)


def test_the_driver_passes_the_salt_to_the_engine_and_refuses_bad_ones_first(model_and_expected,
                                                                            in_process_cluster, short_prefixes):
    """Through Launcher (in-process group): generate, stream and agenerate share a cached prompt only
    under the salt it was cached with; an empty or non-string salt, or one with static batching, is
    refused before anything runs."""
    from launcher.api import Launcher
    from tests.test_replicas import PROMPTS

    model_dir, expected = model_and_expected
    prompt = PROMPTS[0]
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, **EAGER) as llm:
        for bad in ("", 3, b"salt"):
            with pytest.raises(ValueError, match=r"cache_salt \(.*\) must be a non-empty string; leave it out"):
                llm.generate([prompt], cache_salt=bad)
            with pytest.raises(ValueError, match=r"cache_salt \(.*\) must be a non-empty string"):
                llm.stream(prompt, cache_salt=bad)
        with pytest.raises(ValueError, match=r"cache_salt \('a'\) needs batching='continuous'"):
            llm.generate([prompt], cache_salt="a", batching="static")
        assert llm.load() == {"running": 0, "waiting": 0}
        [first] = llm.generate([prompt], max_new_tokens=NEW_TOKENS, cache_salt="a")
        [other] = llm.generate([prompt], max_new_tokens=NEW_TOKENS, cache_salt="b")
        [unsalted] = llm.generate([prompt], max_new_tokens=NEW_TOKENS)
        deltas = list(llm.stream(prompt, max_new_tokens=NEW_TOKENS, cache_salt="a"))

        async def salted(salt):
            [result] = await llm.agenerate([prompt], max_new_tokens=NEW_TOKENS, cache_salt=salt)
            return result
        async_b, async_c = asyncio.run(salted("b")), asyncio.run(salted("c"))  # b's row holds the prompt
    assert [first.cached_prompt_tokens, other.cached_prompt_tokens, unsalted.cached_prompt_tokens] == [0, 0, 0]
    assert [d.cached_tokens for d in deltas if d.cached_tokens is not None] == [len(prompt) - 1]
    assert (async_b.cached_prompt_tokens, async_c.cached_prompt_tokens) == (len(prompt) - 1, 0)
    for tokens in (first.token_ids, other.token_ids, unsalted.token_ids, [t for d in deltas for t in d.token_ids],
                   async_b.token_ids, async_c.token_ids):
        assert tokens == expected[0]


def test_a_resumed_stream_keeps_its_salt():
    from launcher.cluster.stream_handle import StreamHandle
    from workers.sampling import SamplingParams
    from workers.serving.requests import StreamRequest, TokenEvent

    handle = StreamHandle(StreamRequest("r", (1, 2, 3), SamplingParams(), 5, cache_salt="tenant-7"),
                          lambda item: None, 60)
    handle.deliver(TokenEvent("r", [9]))
    again = handle.resumed()
    assert again.cache_salt == "tenant-7" and again.prompt_token_ids == (1, 2, 3, 9)


# ---- the OpenAI request bodies -----------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_api_takes_a_salt_and_refuses_an_empty_or_non_string_one(endpoint):
    from launcher.serving.openai_protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError,
                                                  parse_request)

    model, base = ((CompletionRequest, {"model": "m", "prompt": "hi"}) if endpoint == "completions" else
                   (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert parse_request(model, {**base, "cache_salt": "tenant-7"}).cache_salt == "tenant-7"
    assert parse_request(model, base).cache_salt is None
    assert parse_request(model, {**base, "cache_salt": None}).cache_salt is None
    for bad, shown in (("", "''"), (7, "7"), (["a"], '["a"]')):
        with pytest.raises(ProtocolError) as caught:
            parse_request(model, {**base, "cache_salt": bad})
        err = caught.value
        assert err.status == 400 and err.param == "cache_salt" and err.body()["error"]["param"] == "cache_salt"
        assert err.message.startswith(f"cache_salt ({shown}) must be a non-empty string"), err.message
