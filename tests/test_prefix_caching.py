"""Prefix caching in the serving loop (workers/serving/prefix_reuse.py): a finished request's row keeps
its prompt and output; a later prompt that starts the same way is seated there, or gets the shared
slots copied into its own row (from a free row or a running one, on every rank), or waits for a
running request's prefill of their shared prefix, and is prefilled only from where they part; its
tokens are those of the same prompt run alone. Also: the driver's and the plan's side, the prefill
calls that continue a row (eager reads to their end), and longrope, where nothing is reused."""

from __future__ import annotations

import random

import pytest

from tests.serving_driver import collect, count_prefill_calls, request, run_loops, stop
from tests.test_engine import PROMPTS, alone, fresh_model
from tests.test_replicas import model_and_expected  # noqa: F401 - fixture
from workers.serving.loop import ServingConfig, ServingLoop
from workers.serving import prefix_reuse
from workers.serving.prefix_reuse import RowHistories, Seat, common_prefix_length
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
    # the prompt starts with row 2's whole history: seated there, nothing of it lost
    assert h.choose([0, 1, 2], (1, 2, 3, 4, 5), reuse=True) == Seat(2, 4)
    # the prompt's last token is always prefilled (its logits choose the first new token), so row 2
    # would lose its fourth token: the shared three are copied into the blank row instead
    assert h.choose([0, 1, 2], (1, 2, 3, 4), reuse=True) == Seat(1, 3, copy_from=2)
    assert h.choose([0, 2], (1, 2, 3, 4), reuse=True) == Seat(2, 3)  # no blank row: taken itself
    assert h.choose([0, 1, 2], (7, 7), reuse=True) == Seat(1)  # nothing shared: a blank row first
    assert h.choose([0, 2], (7, 7), reuse=True) == Seat(2)  # then the row freed longest ago
    assert h.choose([0, 1, 2], (1, 2, 3, 4, 5), reuse=False) == Seat(1)  # prompt_logprobs: nothing reused
    assert h.choose([0, 1, 2], (1,), reuse=True) == Seat(1)  # one token: nothing can be skipped
    h.forget(2)
    assert h.choose([0, 1, 2], (1, 2, 3, 4, 5), reuse=True) == Seat(1, 2, copy_from=0)
    # no blank row: the smaller loss is taken, the source's past beyond the prompt (3 tokens) or the
    # past of the row freed longest ago beyond what it shares with the prompt (2, then 4)
    h = RowHistories()
    h.keep(2, (5, 5))
    h.keep(3, (1, 2, 3, 8, 5, 6))
    assert h.choose([2, 3], (1, 2, 3, 9), reuse=True) == Seat(2, 3, copy_from=3)
    h.keep(2, (5, 5, 5, 5))
    h.keep(3, (1, 2, 3, 8, 5, 6))
    assert h.choose([2, 3], (1, 2, 3, 9), reuse=True) == Seat(3, 3)


def test_a_running_rows_prefix_is_copied_into_a_free_row(short_prefixes):
    h = RowHistories()
    h.keep(1, (1, 2))
    running = {0: (None, (1, 2, 3, 4, 5, 6)), 3: (None, (1, 2, 3, 8))}  # (cache_salt, token ids) per row
    assert h.choose([1, 2], (1, 2, 3, 4, 7), reuse=True, in_use=running) == Seat(2, 4, copy_from=0)
    assert h.choose([1], (1, 2, 3, 4, 7), reuse=True, in_use=running) == Seat(1, 4, copy_from=0)
    assert h.choose([1, 2], (1, 2, 9), reuse=True, in_use=running) == Seat(1, 2)  # a free row ties: no copy
    assert h.choose([1, 2], (1, 2, 3, 4, 7), reuse=False, in_use=running) == Seat(2)


def test_a_prefix_shorter_than_the_minimum_is_prefilled_again():
    h = RowHistories()
    held = tuple(range(100))
    h.keep(0, held)
    short = prefix_reuse.MIN_SHARED_TOKENS - 1
    assert h.choose([0, 1], held[:short] + (999,) * 50, reuse=True) == Seat(1)
    assert h.choose([0, 1], held[:short + 1] + (999,) * 50, reuse=True) == Seat(1, short + 1, copy_from=0)
    assert h.choose([0, 1], held + (999,), reuse=True) == Seat(0, 100)


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


def test_the_plan_carries_copies_and_the_cache_copies_a_prefix_byte_for_byte():
    import torch

    from workers.kv_cache import KVCache
    from workers.serving.step_plan import ClearRow, Command, CopyPrefix, PlanCodec, PrefillChunk, StepPlan

    codec = PlanCodec(max_num_seqs=3, max_prefill_tokens=8)
    plan = StepPlan(Command.WORK, (PrefillChunk(2, 5, (7, 8, 9)),), clears=(ClearRow(1, 4),),
                    copies=(CopyPrefix(0, 2, 5), CopyPrefix(0, 1, 3)))
    assert codec.decode(codec.encode(plan)) == plan
    with pytest.raises(ValueError, match="4 to copy exceeds max_num_seqs 3"):
        codec.encode(StepPlan(Command.WORK, copies=(CopyPrefix(0, 1, 1),) * 4))
    for dtype in (torch.float32, torch.float8_e4m3fn):
        cache = KVCache(num_layers=2, batch=3, kv_heads=2, max_seq_len=8, head_dim=4, dtype=dtype)
        for tensor in cache.k + cache.v:
            tensor.copy_(torch.randn(tensor.shape).to(dtype))
        before = [t.clone() for t in cache.k + cache.v]
        cache.copy_prefix(0, 2, 5)
        for old, new in zip(before, cache.k + cache.v):
            as_bytes = (lambda t: t.view(torch.uint8)) if dtype != torch.float32 else (lambda t: t)
            assert torch.equal(as_bytes(new[2, :, :5]), as_bytes(old[0, :, :5]))  # the prefix, bit for bit
            assert torch.equal(as_bytes(new[2, :, 5:]), as_bytes(old[2, :, 5:]))  # the rest of the row kept
            assert torch.equal(as_bytes(new[:2]), as_bytes(old[:2]))


def test_a_request_arriving_while_another_decodes_copies_its_prefix(short_prefixes):
    """The second prompt starts with the first's prompt while the first still runs: its row gets the
    shared slots copied from the first's row, and both equal their prompts run alone."""
    loop = caching_loop(max_num_seqs=2)
    threads = run_loops([loop])
    first = tuple(PROMPTS[0])
    second = first + (3, 14, 15)
    loop.submit([request("first", first, 12)])
    arrived = []

    def arrive(event):
        if event.request_id == "first" and not arrived:
            arrived.append(event)
            loop.submit([request("second", second, 6)])

    got = collect(loop, {"first", "second"}, on_event=arrive)
    stop([loop], threads)
    assert got.tokens["first"] == alone(first, 12) and got.tokens["second"] == alone(second, 6)
    assert cached_tokens(got, "second") == len(first)  # the prompt, and no generated token: (3,) differs
    assert got.finish["first"] == "length"


def test_tp2_followers_copy_the_prefix_the_leader_plans(model_and_expected, in_process_cluster, short_prefixes):
    """Through Launcher at TP 2: a stream's prompt is copied, on both ranks, into the row of a request
    that starts with it while the stream runs; that request's tokens are the static engine's."""
    from launcher.api import Launcher
    from tests.test_replicas import EAGER, PROMPTS

    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=2, progress=False, **EAGER) as llm:
        running = llm.stream(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        next(running)
        follow = PROMPTS[0] + [3, 14]
        [copied] = llm.generate([follow], max_new_tokens=6)
        [static] = llm.generate([follow], max_new_tokens=6, batching="static")
        running.close()
    assert copied.cached_prompt_tokens >= len(PROMPTS[0]) and copied.token_ids == static.token_ids


def test_a_longrope_model_whose_rows_outgrow_its_original_context_reuses_nothing(short_prefixes):
    """longrope rotates every key of a forward with its long factors once the forward's sequence
    outgrows the original context: a 20-token prompt's keys are not what a 7-token prompt sharing its
    first 6 tokens gets prefilled whole (the first token's logits differed by 4, other tokens came
    out). Rows longer than that context keep prefix caching off; rows within it keep it on."""
    from tests.test_llama_variants import CONTEXT, longrope_model

    long_prompt = (5, 9, 33, 17, 80, 3, 7, 100, 21, 4, 66, 8, 120, 3, 44, 12, 50, 51, 52, 53)
    short_prompt = long_prompt[:6] + (99,)
    assert len(short_prompt) < CONTEXT < len(long_prompt)

    def run(caching: bool, slots: int, first, new_tokens: int = 4) -> tuple[list[int], int | None]:
        model, _ = longrope_model()
        loop = ServingLoop(model, ServingConfig(1, 64, slots, prefix_caching=caching))
        threads = run_loops([loop])
        loop.submit([request("first", first, new_tokens)])
        collect(loop, {"first"})
        loop.submit([request("short", short_prompt, new_tokens)])
        got = collect(loop, {"short"})
        stop([loop], threads)
        return got.tokens["short"], cached_tokens(got, "short")

    assert run(True, 32, long_prompt) == (run(False, 32, long_prompt)[0], 0)
    within = short_prompt[:6] + (1,)  # rows of CONTEXT slots: every forward uses the short factors
    assert run(True, CONTEXT, within, new_tokens=1)[1] == 6


def test_a_burst_behind_one_prefix_prefills_it_once_and_copies_it():
    """Three prompts sharing 40 leading tokens arrive together: the first is seated and prefilled, the
    others wait for it (rows free or not) while it has at least MIN_SHARED_TOKENS more of their
    prefix to write, then copy what it wrote; one asking for prompt log-probabilities, which reuses
    nothing, is seated at once."""
    assert prefix_reuse.MIN_SHARED_TOKENS == 16
    shared = tuple(range(100, 140))
    sched = Scheduler(max_num_seqs=4, max_prefill_tokens=64, max_chunk=16, prefix_caching=True)
    for rid, tail in (("a", (1, 2)), ("b", (3, 4)), ("c", (5,))):
        sched.add(Sequence(request(rid, shared + tail, 4)))
    sched.add(Sequence(request("scored", shared + (6,), 4, prompt_logprobs=0)))
    plan = sched.schedule()
    assert sorted(sched.running) == ["a", "scored"] and [s.request.request_id for s in sched.waiting] == ["b", "c"]
    assert plan.copies == () and [c.start for c in plan.prefills] == [0, 0]
    a = sched.running["a"]
    a.prefilled = 16  # its first chunk ran: 24 of the shared tokens are still to come
    plan = sched.schedule()
    assert [s.request.request_id for s in sched.waiting] == ["b", "c"] and plan.copies == ()
    a.prefilled = 32  # 8 to come: not worth another wait
    plan = sched.schedule()
    b, c = sched.running["b"], sched.running["c"]
    assert [(p.source, p.row, p.slots) for p in plan.copies] == [(a.row, b.row, 32), (a.row, c.row, 32)]
    assert (b.cached, c.cached) == (32, 32) and not sched.waiting
    assert [(p.row, p.start, len(p.token_ids)) for p in plan.prefills][-2:] == [(b.row, 32, 10), (c.row, 32, 9)]


def test_a_request_held_back_for_a_prefix_keeps_its_place_in_line_for_a_row():
    """B waits for A's prefill of their shared prefix; C, arriving after B and sharing nothing, took
    the last free row, so B waited for A's or C's whole answer (200 tokens) rather than A's prefill:
    with prefix caching on, a short request behind one system prompt lost its turn to later ones."""
    shared = tuple(range(100, 164))
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=16, max_chunk=16, prefix_caching=True)
    sched.add(Sequence(request("A", shared + (1,), 200)))
    sched.add(Sequence(request("B", shared + (2,), 4)))
    sched.add(Sequence(request("C", (7, 8, 9), 200)))
    sched.schedule()
    assert list(sched.running) == ["A"] and [s.request.request_id for s in sched.waiting] == ["B", "C"]
    a = sched.running["A"]
    a.prefilled, a.generated, a.pending = len(a.prompt), 1, 5  # its prefill is done, a token chosen
    plan = sched.schedule()
    assert list(sched.running) == ["A", "B"] and [s.request.request_id for s in sched.waiting] == ["C"]
    assert [(p.source, p.row, p.slots) for p in plan.copies] == [(a.row, sched.running["B"].row, len(shared))]


def test_a_burst_behind_one_prefix_equals_each_prompt_alone():
    loop = caching_loop(max_num_seqs=3, max_prefill_tokens=64)
    threads = run_loops([loop])
    shared = tuple(range(1, 25))
    prompts = {"a": shared + (90,), "b": shared + (91, 92), "c": shared + (93,)}
    loop.submit([request(rid, p, 5) for rid, p in prompts.items()])
    got = collect(loop, set(prompts))
    stop([loop], threads)
    for rid, prompt in prompts.items():
        assert got.tokens[rid] == alone(prompt, 5), rid
    assert [cached_tokens(got, rid) for rid in prompts] == [0, 24, 24]


def test_generate_and_serve_turn_it_off_with_one_flag():
    import argparse

    from launcher.cli import generate_command, serve_command
    from launcher.serving.server_settings import settings_from_args

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    generate_command.add_parser(commands)
    serve_command.add_parser(commands)
    assert generate_command.launch_config(parser.parse_args(["generate", "--tp", "1", "x"])).prefix_caching
    assert not generate_command.launch_config(
        parser.parse_args(["generate", "--tp", "1", "--no-prefix-caching", "x"])).prefix_caching
    served = serve_command.server_args(parser.parse_args(["serve", "--backend", "cpu", "--no-prefix-caching"]))
    assert settings_from_args(served).launch["prefix_caching"] is False
    assert "prefix_caching" not in serve_command.server_args(parser.parse_args(["serve", "--backend", "cpu"]))
    with pytest.raises(ValueError, match=r"prefix_caching \(3\) must be True or False"):
        settings_from_args({"prefix_caching": 3, "backend": "cpu"})


def test_a_cpu_warm_up_builds_no_graph_for_chunks_that_continue_a_sequence():
    """The cpu backend runs every continuing prefill call eagerly, so the shapes a warm-up builds (the
    rank asks for them as below) leave those graphs out; a model without an eager step keeps them."""
    from shardlib.buckets import Buckets
    from shardlib.serving_shapes import PREFILL_CONTINUE, ServingShapes
    from workers.compiled import CompiledCausalLM

    buckets = Buckets.build(max_seq_len=32, context=(4, 8), token=(16, 32))
    shapes = ServingShapes.build(buckets, max_num_seqs=2, max_prefill_tokens=8)
    everything = shapes.shapes()
    started_only = shapes.shapes(continuing=False)
    assert started_only == [s for s in everything if s[0] != PREFILL_CONTINUE] and len(started_only) < len(everything)
    loop = ServingLoop(CompiledCausalLM(fresh_model(), buckets, announce=lambda line: None),
                       ServingConfig(2, 8, 32, shapes))
    assert loop.continues_eagerly
    assert not ServingLoop(fresh_model(), ServingConfig(2, 8, 32)).continues_eagerly  # eager: no graphs at all
