"""Prefix caching in the serving loop (workers/serving/prefix_reuse.py): a finished request's row keeps
its prompt and output, a later prompt that starts the same way is seated there and prefilled only
from where they part, and its tokens are those of the same prompt run alone."""

from __future__ import annotations

import random

import pytest

from tests.serving_driver import collect, count_prefill_calls, request, run_loops, stop
from tests.test_engine import PROMPTS, alone, fresh_model
from tests.test_replicas import model_and_expected  # noqa: F401 - fixture
from workers.serving.loop import ServingConfig, ServingLoop
from workers.serving import prefix_reuse
from workers.serving.prefix_reuse import RowHistories, common_prefix_length
from workers.serving.scheduler import Scheduler, Sequence


@pytest.fixture
def short_prefixes(monkeypatch):
    """Prefixes of any length are reused (the tiny test prompts share fewer than MIN_SHARED_TOKENS)."""
    monkeypatch.setattr(prefix_reuse, "MIN_SHARED_TOKENS", 1)


def caching_loop(max_num_seqs=2, max_prefill_tokens=8, prefix_caching=True) -> ServingLoop:
    return ServingLoop(fresh_model(), ServingConfig(max_num_seqs, max_prefill_tokens, 64,
                                                    prefix_caching=prefix_caching))


def cached_tokens(got, rid: str) -> int | None:
    values = [e.cached_tokens for e in got.events if e.request_id == rid and e.cached_tokens is not None]
    assert len(values) <= 1, f"{rid}: cached_tokens on {len(values)} events, expected the first token's only"
    return values[0] if values else None


def naive_common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_length_matches_a_plain_scan():
    rng = random.Random(7)
    for _ in range(400):
        n = rng.choice([0, 1, 5, 63, 64, 65, 130, 700])
        a = tuple(rng.randrange(4) for _ in range(n))
        b = list(a[:rng.randrange(n + 1)]) + [rng.randrange(4) for _ in range(rng.randrange(80))]
        assert common_prefix_length(a, tuple(b)) == naive_common_prefix(a, b), (a, b)
        assert common_prefix_length(tuple(b), a) == naive_common_prefix(a, b)


def test_rows_are_chosen_by_longest_shared_prefix_then_blank_then_least_recently_freed(short_prefixes):
    h = RowHistories()
    h.keep(2, (1, 2, 3, 4))
    h.keep(0, (1, 2, 9))
    assert h.choose([0, 1, 2], (1, 2, 3, 4, 5), reuse=True) == (2, 4)
    # the prompt's last token is always prefilled (its logits choose the first new token)
    assert h.choose([0, 1, 2], (1, 2, 3, 4), reuse=True) == (2, 3)
    assert h.choose([0, 1, 2], (7, 7), reuse=True) == (1, 0)  # nothing shared: a blank row first
    assert h.choose([0, 2], (7, 7), reuse=True) == (2, 0)  # then the row freed longest ago
    assert h.choose([0, 1, 2], (1, 2, 3, 4, 5), reuse=False) == (1, 0)  # prompt_logprobs: nothing reused
    assert h.choose([0, 1, 2], (1,), reuse=True) == (1, 0)  # one token: nothing can be skipped
    h.forget(2)
    assert h.choose([0, 1, 2], (1, 2, 3, 4, 5), reuse=True) == (0, 2)


def test_a_prefix_shorter_than_the_minimum_is_prefilled_again():
    h = RowHistories()
    held = tuple(range(100))
    h.keep(0, held)
    short = prefix_reuse.MIN_SHARED_TOKENS - 1
    assert h.choose([0, 1], held[:short] + (999,) * 50, reuse=True) == (1, 0)
    assert h.choose([0, 1], held[:short + 1] + (999,) * 50, reuse=True) == (0, short + 1)


def test_the_scheduler_seats_a_prompt_where_its_prefix_is_and_starts_its_chunks_there(short_prefixes):
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=16, max_chunk=8, prefix_caching=True)
    sched.add(Sequence(request("a", range(10, 16), 4)))
    sched.schedule()
    a = sched.running["a"]
    a.prefilled, a.generated, a.output_ids = 6, 3, [70, 71, 72]  # as the loop records them
    sched.finish(a)  # its row holds the prompt and the first two tokens (the third was never fed back)
    assert sched.histories.held(0) == (10, 11, 12, 13, 14, 15, 70, 71)
    sched.add(Sequence(request("other", (1, 2, 3), 4)))
    sched.add(Sequence(request("b", (10, 11, 12, 13, 14, 15, 70, 99, 98), 4)))
    plan = sched.schedule()
    b = sched.running["b"]
    assert (sched.running["other"].row, b.row, b.cached, b.prefilled) == (1, 0, 7, 7)
    assert [(c.row, c.start, c.token_ids) for c in plan.prefills] == [(1, 0, (1, 2, 3)), (0, 7, (99, 98))]
    assert sched.histories.held(0) == ()  # taken: b writes over it
    b.prefilled = 9
    sched.cancel("b")  # after its prompt: its row keeps what it wrote
    assert sched.histories.held(0) == (10, 11, 12, 13, 14, 15, 70, 99, 98)


def test_rows_cleared_or_asked_for_prompt_logprobs_reuse_nothing():
    sched = Scheduler(max_num_seqs=1, max_prefill_tokens=16, max_chunk=16, prefix_caching=True)
    sched.add(Sequence(request("a", range(8), 4)))
    sched.schedule()
    sched.running["a"].prefilled = 4  # cancelled mid-prefill: its row is zeroed, nothing kept
    sched.cancel("a")
    sched.add(Sequence(request("b", range(8), 4)))
    plan = sched.schedule()
    assert plan.clears[0].row == 0 and [(c.start, len(c.token_ids)) for c in plan.prefills] == [(0, 8)]
    b = sched.running["b"]
    b.prefilled, b.generated, b.output_ids = 8, 1, [5]
    sched.finish(b)
    sched.add(Sequence(request("scored", range(8), 4, prompt_logprobs=0)))
    plan = sched.schedule()
    assert [(c.start, len(c.token_ids)) for c in plan.prefills] == [(0, 8)] and sched.running["scored"].cached == 0


def test_off_by_default_in_the_scheduler():
    sched = Scheduler(max_num_seqs=1, max_prefill_tokens=16, max_chunk=16)
    sched.add(Sequence(request("a", range(8), 4)))
    sched.schedule()
    a = sched.running["a"]
    a.prefilled, a.generated, a.output_ids = 8, 2, [1, 2]
    sched.finish(a)
    sched.add(Sequence(request("b", range(8), 4)))
    assert sched.schedule().prefills[0].start == 0 and sched.histories is None


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
def test_a_follow_up_prompt_reuses_the_row_and_equals_its_run_alone(prefix_caching, short_prefixes):
    """A second turn (the first prompt, its answer and more) and a repeated prompt skip what their row
    holds; their tokens are those of their prompts run alone through the static engine."""
    loop = caching_loop(prefix_caching=prefix_caching)
    threads = run_loops([loop])
    first = tuple(PROMPTS[0])
    loop.submit([request("first", first, 10)])
    got = collect(loop, {"first"})
    follow = first + tuple(got.tokens["first"][:9]) + (3, 14, 15)
    loop.submit([request("follow", follow, 10)])
    more = collect(loop, {"follow"})
    loop.submit([request("again", first, 10), request("other", PROMPTS[1], 10)])
    again = collect(loop, {"again", "other"})
    stop([loop], threads)
    assert got.tokens["first"] == alone(first) and cached_tokens(got, "first") == 0
    assert more.tokens["follow"] == alone(follow)
    assert again.tokens["again"] == alone(first) and again.tokens["other"] == alone(tuple(PROMPTS[1]))
    if prefix_caching:  # the follow-up shares the prompt and the 9 tokens fed back; the repeat all but its last
        assert cached_tokens(more, "follow") == len(first) + 9
        assert cached_tokens(again, "again") == len(first) - 1 and cached_tokens(again, "other") == 0
    else:
        assert cached_tokens(more, "follow") == 0 and cached_tokens(again, "again") == 0


def test_the_driver_reports_cached_prompt_tokens_once_even_across_a_restart(model_and_expected, in_process_cluster,
                                                                           short_prefixes):
    """Through Launcher (TP 2: the follower runs the leader's chunks from where the prefix ends): a
    follow-up prompt's result counts the tokens its row held and equals the static engine's tokens
    for it; a stream resumed after a group fault reports its first attempt's count alone."""
    from launcher.api import Launcher
    from launcher.errors import WorkerDied
    from tests.test_replicas import EAGER, NEW_TOKENS, PROMPTS

    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=1, progress=False, **EAGER) as llm:
        [first] = llm.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS)
        assert first.token_ids == expected[0] and first.cached_prompt_tokens == 0
        follow = PROMPTS[0] + expected[0][:NEW_TOKENS - 1] + [3]
        [cached] = llm.generate([follow], max_new_tokens=NEW_TOKENS)
        [static] = llm.generate([follow], max_new_tokens=NEW_TOKENS, batching="static")
        assert cached.cached_prompt_tokens == len(PROMPTS[0]) + NEW_TOKENS - 1
        assert cached.token_ids == static.token_ids and static.cached_prompt_tokens == 0
        stream = llm.stream(follow, max_new_tokens=NEW_TOKENS)
        deltas = [next(stream)]
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        deltas.extend(stream)
        assert llm.replica_status()[0]["restarts"] == 1 and stream.handle.attempts == 2
    assert [t for d in deltas for t in d.token_ids] == static.token_ids
    assert [d.cached_tokens for d in deltas if d.cached_tokens is not None] == [len(follow) - 1]


def test_continuing_chunks_read_to_their_furthest_end_eagerly_and_whole_rows_through_graphs():
    from shardlib.buckets import Buckets
    from shardlib.serving_shapes import ServingShapes
    from workers.serving.step_inputs import prefill_inputs
    from workers.serving.step_plan import PrefillChunk

    chunks = [PrefillChunk(0, 40, (1, 2, 3)), PrefillChunk(1, 0, (4, 5))]
    assert prefill_inputs(chunks, None, scratch_row=4, cache_slots=256).read_slots == 43
    assert prefill_inputs(chunks[1:], None, scratch_row=4, cache_slots=256).read_slots == 2
    shapes = ServingShapes.build(Buckets.build(max_seq_len=256, context=(128,), token=(256,)), max_num_seqs=4,
                                 max_prefill_tokens=512)
    assert prefill_inputs(chunks, shapes, scratch_row=4, cache_slots=256).read_slots == 256


def test_a_compiled_loop_runs_a_short_turn_after_a_cached_prefix_eagerly():
    """The follow-up's chunk continues its row at slot 127: its graph would attend over all 256
    slots, eagerly it reads 130. The first prompt (120 tokens in the 128 bucket) keeps its graph."""
    import torch

    from shardlib.buckets import Buckets
    from shardlib.serving_shapes import ServingShapes
    from workers.compiled import CompiledCausalLM

    torch._dynamo.reset()
    buckets = Buckets.build(max_seq_len=256, context=(128,), token=(256,))
    shapes = ServingShapes.build(buckets, max_num_seqs=2, max_prefill_tokens=128)
    model = CompiledCausalLM(fresh_model(), buckets, announce=lambda line: None)
    calls = count_prefill_calls(model)
    loop = ServingLoop(model, ServingConfig(2, 128, 256, shapes, prefix_caching=True))
    threads = run_loops([loop])
    first = tuple(range(1, 41)) * 3
    loop.submit([request("first", first, 8)])
    got = collect(loop, {"first"})
    follow = first + tuple(got.tokens["first"][:7]) + (5, 6, 7)
    loop.submit([request("follow", follow, 4)])
    more = collect(loop, {"follow"})
    stop([loop], threads)
    assert calls == {"eager": 1, "graph": 1} and cached_tokens(more, "follow") == 127
    assert got.tokens["first"] == alone(first, 8) and more.tokens["follow"] == alone(follow, 4)
