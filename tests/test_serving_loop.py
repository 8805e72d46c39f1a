"""The serving loop in-process: continuous batching with chunked prefill equals each prompt run
alone (eager and compiled, TP 1 and TP 2 with rank 0 leading), rows are freed and reused, stop
tokens, lengths, logprobs, seeds and cancellation behave, static batches still run, and no graph is
built after warm-up."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from shardlib.serving_shapes import ServingShapes
from tests.serving_driver import collect, request, run_loops, stop
from tests.test_engine import PROMPTS, alone, fresh_model, hf_model
from tests.tp_harness import InProcessGroup, build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.sampling import SamplingParams
from workers.serving.loop import ServingConfig, ServingLoop
from workers.serving.scheduler import Scheduler, Sequence
from workers.serving.step_plan import ClearRow, Command, DecodeRow, PlanCodec, PrefillChunk, StepPlan

MORE_PROMPTS = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [11], [64, 32, 16, 8]]


def eager_loop(max_num_seqs=2, max_prefill_tokens=4, slots=64, model=None) -> ServingLoop:
    return ServingLoop(model or fresh_model(), ServingConfig(max_num_seqs, max_prefill_tokens, slots))


def test_plan_round_trips_through_its_tensor():
    codec = PlanCodec(max_num_seqs=3, max_prefill_tokens=8)
    plan = StepPlan(Command.WORK, (PrefillChunk(2, 5, (7, 8, 9)), PrefillChunk(0, 0, (1,), scored=True)),
                    (DecodeRow(1, 40, 99),), clears=(ClearRow(2, 17),))
    assert codec.decode(codec.encode(plan)) == plan
    with pytest.raises(ValueError, match="max_prefill_tokens 8"):
        codec.encode(StepPlan(Command.WORK, (PrefillChunk(0, 0, tuple(range(9))),)))


def test_scheduler_budgets_chunks_and_reuses_rows():
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=5, max_chunk=4)
    for rid, n in (("a", 6), ("b", 3), ("c", 2)):
        sched.add(Sequence(request(rid, range(n), 4)))
    plan = sched.schedule()
    # a takes row 0 and a 4-token chunk (the largest chunk), b row 1 and what is left of the budget
    assert [(c.row, c.start, len(c.token_ids)) for c in plan.prefills] == [(0, 0, 4), (1, 0, 1)]
    assert sched.load() == {"running": 2, "waiting": 1}
    sched.cancel("a")  # mid-prefill: its row comes back through the next plan, which clears it first
    assert sched.free_rows == [] and [c.row for c in sched.rows_to_clear] == [0]
    plan = sched.schedule()  # c is seated in a's row at once
    assert sched.running["c"].row == 0 and sched.load() == {"running": 2, "waiting": 0}
    assert [c.row for c in plan.clears] == [0]
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence(request("c", [1], 1)))


def test_continuous_batch_with_chunked_prefill_equals_each_prompt_alone():
    loop = eager_loop(max_num_seqs=2, max_prefill_tokens=4)
    threads = run_loops([loop])
    loop.submit([request(f"r{i}", p, 10) for i, p in enumerate(MORE_PROMPTS)])
    got = collect(loop, {f"r{i}" for i in range(len(MORE_PROMPTS))})
    stop([loop], threads)
    for i, prompt in enumerate(MORE_PROMPTS):
        assert got.tokens[f"r{i}"] == alone(tuple(prompt)) and got.finish[f"r{i}"] == "length"
    assert loop.scheduler.free_rows == [0, 1]


def test_requests_arriving_mid_stream_equal_their_runs_alone():
    loop = eager_loop(max_num_seqs=3, max_prefill_tokens=6)
    threads = run_loops([loop])
    pending = [request(f"r{i}", p, 10) for i, p in enumerate(MORE_PROMPTS)]
    loop.submit([pending.pop(0)])

    def arrive(event):  # a new request each time a token comes out
        if pending:
            loop.submit([pending.pop(0)])

    got = collect(loop, {f"r{i}" for i in range(len(MORE_PROMPTS))}, on_event=arrive)
    stop([loop], threads)
    for i, prompt in enumerate(MORE_PROMPTS):
        assert got.tokens[f"r{i}"] == alone(tuple(prompt))


def test_stop_tokens_lengths_logprobs_and_cancellation():
    full = alone(tuple(PROMPTS[0]))
    loop = eager_loop(max_num_seqs=1, max_prefill_tokens=16)
    threads = run_loops([loop])
    loop.submit([request("stopped", PROMPTS[0], 10, stop_token_ids=(full[3],)),
                 request("short", PROMPTS[1], 2, logprobs=3),
                 request("long", PROMPTS[2], 40)])
    got = collect(loop, {"stopped", "short"})
    assert got.tokens["stopped"] == full[:4] and got.finish["stopped"] == "stop"
    assert got.finish["short"] == "length" and len(got.tokens["short"]) == 2
    lps = [lp for e in got.events if e.request_id == "short" for lp in (e.logprobs or [])]
    assert len(lps) == 2
    for lp, token in zip(lps, got.tokens["short"]):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy: the chosen token is the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    loop.cancel(["long"])  # it holds the only row; cancelling frees it for the next request
    loop.submit([request("after", PROMPTS[1], 3)])
    more = collect(loop, {"long", "after"})
    stop([loop], threads)
    assert more.finish["long"] == "abort" and len(more.tokens["long"]) < 40
    assert more.tokens["after"] == alone(tuple(PROMPTS[1]))[:3]


def test_seeded_sampling_does_not_depend_on_the_batch():
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=1234)
    runs = []
    for companions in (0, 3):
        loop = eager_loop(max_num_seqs=4, max_prefill_tokens=32)
        threads = run_loops([loop])
        loop.submit([request("s", PROMPTS[0], 12, sampling=sampled)]
                    + [request(f"o{i}", p, 12) for i, p in enumerate(PROMPTS[:companions])])
        runs.append(collect(loop, {"s"} | {f"o{i}" for i in range(companions)}).tokens["s"])
        stop([loop], threads)
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_a_seeded_request_resubmitted_with_its_first_tokens_draws_the_rest_alike():
    """What a resume after a fault submits: the prompt plus the tokens delivered, and the draws
    already made; the rest of a seeded stream is then the same as without the fault."""
    sampled = SamplingParams(temperature=1.0, seed=99)
    loop = eager_loop(max_num_seqs=2, max_prefill_tokens=32)
    threads = run_loops([loop])
    loop.submit([request("s", PROMPTS[0], 8, sampling=sampled)])
    whole = collect(loop, {"s"}).tokens["s"]
    loop.submit([request("t", tuple(PROMPTS[0]) + tuple(whole[:3]), 5, sampling=sampled, draws_before=3)])
    rest = collect(loop, {"t"}).tokens["t"]
    stop([loop], threads)
    assert rest == whole[3:] and len(whole) == 8


def test_an_idle_loop_gathers_a_burst_into_one_prefill():
    """Requests arriving a little apart at an idle group are prefilled in one iteration when
    burst_wait_s covers the gaps; one step then gives every request its only token."""
    # 2 s, not 0.5: a loaded machine may hold this thread between the two submits; and the counter's
    # bound below stays far under the 2 s of gathering the bug counted
    loop = ServingLoop(fresh_model(), ServingConfig(4, 64, 64, burst_wait_s=2.0))
    threads = run_loops([loop])
    loop.submit([request("a", PROMPTS[0], 1)])
    time.sleep(0.05)
    loop.submit([request("b", PROMPTS[1], 1)])
    got = collect(loop, {"a", "b"})
    stop([loop], threads)
    assert loop.steps == 1
    assert got.tokens["a"] == alone(tuple(PROMPTS[0]))[:1] and got.tokens["b"] == alone(tuple(PROMPTS[1]))[:1]
    # the overhead counter leaves out the wait for work and the burst gathered (it counted both:
    # at least the 2 s burst wait here)
    assert loop.plan_seconds < 1.0, loop.plan_seconds


def test_a_burst_is_not_waited_for_past_the_free_rows():
    """With every row taken by what has arrived, the leader starts at once, however long the burst
    wait: nothing more could run in this iteration."""
    # a long wait (5 s), so the bound leaves a loaded machine room for the prefill itself
    loop = ServingLoop(fresh_model(), ServingConfig(1, 64, 64, burst_wait_s=5.0))
    threads = run_loops([loop])
    sent = time.monotonic()
    loop.submit([request("only", PROMPTS[0], 1)])
    got = collect(loop, {"only"})
    waited = time.monotonic() - sent
    stop([loop], threads)
    assert got.finish["only"] == "length" and waited < 5.0, f"the lone request waited {waited:.2f} s"


def test_a_steady_trickle_is_not_waited_for_past_the_cap():
    """Requests arriving closer together than burst_wait_s, for longer than BURST_WAIT_CAP waits:
    the leader stops gathering at the cap, so the first request's token comes long before the
    trickle ends (and every request is still served)."""
    from workers.serving.burst import BURST_WAIT_CAP

    wait_s, gap_s, count = 0.06, 0.04, 40
    assert BURST_WAIT_CAP * wait_s < count * gap_s  # the cap ends the gathering, not the trickle
    # every prompt fits one step's budget and rows (sum of lengths <= 256, 40 <= 48): uncapped, a
    # steady trickle is prefilled all in one step, after its end
    assert sum(len(PROMPTS[i % len(PROMPTS)]) for i in range(count)) <= 256
    loop = ServingLoop(fresh_model(), ServingConfig(48, 256, 64, burst_wait_s=wait_s))
    prefills_per_step: list[int] = []
    real_schedule = loop.scheduler.schedule

    def schedule():
        plan = real_schedule()
        if plan is not None and plan.prefills:
            prefills_per_step.append(len(plan.prefills))
        return plan

    loop.scheduler.schedule = schedule
    threads = run_loops([loop])

    def trickle():
        for i in range(count):
            loop.submit([request(f"t{i}", PROMPTS[i % len(PROMPTS)], 1)])
            time.sleep(gap_s)

    sender = threading.Thread(target=trickle)
    sender.start()
    got = collect(loop, {f"t{i}" for i in range(count)})
    sender.join()
    stop([loop], threads)
    assert len(got.finish) == count and all(len(got.tokens[f"t{i}"]) == 1 for i in range(count))
    # the first step (t0's token) ran once the cap ended the gathering, long before the trickle's
    # end: counted, not timed (a wall-clock bound on its token was at the mercy of a loaded machine)
    assert prefills_per_step[0] < count and sum(prefills_per_step) == count, prefills_per_step


def test_static_batches_run_between_iterations():
    from workers.engine import generate

    model = fresh_model()
    loop = ServingLoop(model, ServingConfig(2, 8, 64),
                       run_static=lambda req: generate(model, req, [SamplingParams()] * len(req), 10, []))
    threads = run_loops([loop])
    loop.submit([request("streamed", PROMPTS[2], 10)])
    outputs = loop.static(1, PROMPTS[:2]).result(timeout=60)
    got = collect(loop, {"streamed"})
    stop([loop], threads)
    assert [o.token_ids for o in outputs] == [alone(tuple(p)) for p in PROMPTS[:2]]
    assert got.tokens["streamed"] == alone(tuple(PROMPTS[2]))


def test_a_static_batch_parked_when_the_loop_stops_fails_rather_than_waiting_for_ever():
    ran = []
    loop = ServingLoop(fresh_model(), ServingConfig(2, 8, 64), run_static=ran.append)
    # In the inbox before the loop starts, as when the driver shuts down during a static generate().
    loop.submit([request("streamed", PROMPTS[0], 5)])
    parked = loop.static(1, PROMPTS[:1])
    loop.stop()
    [thread] = run_loops([loop])
    thread.join(30)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="static batch 1 never ran"):
        parked.result(timeout=5)
    with pytest.raises(RuntimeError, match="static batch 2 never ran"):  # parked after the end
        loop.static(2, PROMPTS[:1]).result(timeout=5)
    assert ran == []


def test_returned_logits_are_one_row_each_not_a_view_of_the_steps_rows():
    import pickle

    loop = eager_loop(max_num_seqs=3)
    threads = run_loops([loop])
    loop.submit([request(f"r{i}", PROMPTS[i], 3, return_logits=True) for i in range(3)])
    got = collect(loop, {"r0", "r1", "r2"})
    stop([loop], threads)
    rows = [row for event in got.events if event.logits for row in event.logits]
    assert len(rows) == 9
    vocab_bytes = rows[0].numel() * rows[0].element_size()
    for row in rows:  # a view's pickle carries its whole storage: every row of the step
        assert row.untyped_storage().nbytes() == vocab_bytes
        assert len(pickle.dumps(row)) < vocab_bytes + 1024  # plus pickle's own framing


def tp2_loops(max_num_seqs=2, max_prefill_tokens=5):
    hf = hf_model()
    config, state = ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf)
    ranks = InProcessGroup(2, timeout_s=60).ranks()
    return [ServingLoop(build_rank_model(config, state, r.rank, 2, r),
                        ServingConfig(max_num_seqs, max_prefill_tokens, 64)) for r in ranks]


def test_tp2_followers_run_the_leaders_plans():
    loops = tp2_loops()
    threads = run_loops(loops)
    loops[0].submit([request(f"r{i}", p, 10) for i, p in enumerate(MORE_PROMPTS)])
    time.sleep(0.5)  # idle heartbeats in between must not upset the followers
    got = collect(loops[0], {f"r{i}" for i in range(len(MORE_PROMPTS))})
    stop(loops, threads)
    for i, prompt in enumerate(MORE_PROMPTS):
        assert got.tokens[f"r{i}"] == alone(tuple(prompt))
    assert loops[1].outbox.take(0)[0] == []  # followers post nothing


def test_compiled_loop_builds_no_graph_after_warm_up_and_reads_midpoint_buckets():
    from torch._dynamo.utils import counters

    from workers.compiled import CompiledCausalLM

    torch._dynamo.reset()
    # Token buckets 16 and 32, so decode steps read 16, 24 or 32 slots as histories grow past 16
    # and 24 (the 15-token prompt's last decode step, its 12th token, reads a history of 26). Chunk
    # buckets 4 and 8 of one or two rows, starting a sequence or continuing it (the 15-token
    # prompt), decode of one and two rows: 12 shapes, the ones this load can need and no more. One
    # test for both properties, since each compiled shape costs seconds cold. Chunks of two rows
    # through Ray are compiled in tests/test_compiled.py.
    buckets = Buckets.build(max_seq_len=32, context=(4, 8), token=(16, 32))
    shapes = ServingShapes.build(buckets, max_num_seqs=2, max_prefill_tokens=8)
    assert shapes.read_buckets == (16, 24, 32) and len(shapes.shapes()) == 12
    model = CompiledCausalLM(fresh_model(), buckets, announce=lambda line: None)
    loop = ServingLoop(model, ServingConfig(2, 8, 32, shapes))
    before = counters["stats"]["unique_graphs"]
    with model.warming_up():
        loop.warm_up(shapes.shapes())
    graphs = counters["stats"]["unique_graphs"]
    # warm-up built a graph for every shape (a model that fell back to eager would build none)
    assert {(g.phase, g.batch, g.length) for g in model.stats().graphs} == set(shapes.shapes())
    assert graphs - before >= len(shapes.shapes())
    decode_reads = []  # slots each decode step of the load read
    serve_step = model.serve_step

    def recording(input_ids, position_ids, cache, cache_positions, rows, read_slots, logit_index=None):
        if input_ids.shape[1] == 1:
            decode_reads.append(read_slots)
        return serve_step(input_ids, position_ids, cache, cache_positions, rows, read_slots, logit_index)

    model.serve_step = recording
    threads = run_loops([loop])
    # requests arrive one at a time as events come back: chunks and decode rows of every kind mix
    pending = [request(f"r{i}", p, 12) for i, p in enumerate(MORE_PROMPTS)]
    loop.submit([pending.pop(0)])
    got = collect(loop, {f"r{i}" for i in range(len(MORE_PROMPTS))},
                  on_event=lambda e: pending and loop.submit([pending.pop(0)]))
    stop([loop], threads)
    assert counters["stats"]["unique_graphs"] == graphs  # no graph built during the load
    for i, prompt in enumerate(MORE_PROMPTS):
        assert got.tokens[f"r{i}"] == alone(tuple(prompt), 12)
    assert set(decode_reads) == {16, 24, 32}


def test_decode_reads_the_smallest_read_bucket_token_buckets_and_their_midpoints():
    from shardlib.serving_shapes import with_midpoints

    assert with_midpoints((128, 256, 300)) == (128, 192, 256, 278, 300)
    assert with_midpoints((32,)) == (32,) and with_midpoints((16, 17, 32)) == (16, 17, 25, 32)
    shapes = ServingShapes.build(Buckets.build(max_context_length=128, max_seq_len=256), 32, 2048)
    assert shapes.read_buckets == (128, 192, 256)
    # 16 rows whose longest history is 150 tokens read 192 slots of their 256-slot rows, not 256
    assert shapes.decode_shape(16, 150) == (16, 192) and shapes.decode_shape(3, 193) == (4, 256)
    decode = [s for s in shapes.shapes() if s[0] == "serve-decode"]
    assert decode == [("serve-decode", b, t) for b in (1, 2, 4, 8, 16, 32) for t in (128, 192, 256)]
    # a warm-up for sequences of at most 150 tokens stops at the read bucket holding them
    assert max(t for phase, _, t in shapes.shapes(150) if phase == "serve-decode") == 192


def test_prefill_chunks_of_one_bucket_share_a_call_up_to_the_budget():
    from workers.serving.step_inputs import prefill_batches, prefill_inputs

    buckets = Buckets.build(max_seq_len=64, context=(4, 8), token=(32, 64))
    shapes = ServingShapes.build(buckets, max_num_seqs=8, max_prefill_tokens=16)
    assert shapes.prefill_batch_buckets(4) == (1, 2, 4) and shapes.prefill_batch_buckets(8) == (1, 2)
    assert ("serve-prefill", 4, 4) in shapes.shapes() and ("serve-prefill", 4, 8) not in shapes.shapes()
    chunks = (PrefillChunk(0, 0, (1, 2, 3)), PrefillChunk(1, 0, (1,) * 8), PrefillChunk(2, 4, (5,)),
              PrefillChunk(3, 0, (7, 7)), PrefillChunk(4, 0, (9,)), PrefillChunk(5, 0, (6,) * 5),
              PrefillChunk(6, 0, (2,) * 4))
    # chunk 2 continues its sequence: it reads the whole cache row, so it is not batched with the
    # first chunks of its bucket (they read only their own slots)
    assert prefill_batches(chunks, shapes) == [[0, 3, 4, 6], [1, 5], [2]]
    # Eager: calls of similar lengths, longest first, none padded past the plan's real tokens (one
    # call for all padded every chunk to the longest: up to max_num_seqs x the budget)
    assert prefill_batches(chunks, None) == [[1, 5, 6], [0, 3, 2, 4]]
    uneven = (PrefillChunk(0, 0, (1,) * 2033),) + tuple(PrefillChunk(i, 0, (1,)) for i in range(1, 16))
    calls = prefill_batches(uneven, None)
    assert sorted(sum(calls, [])) == list(range(16))
    assert all(len(call) * max(len(uneven[i].token_ids) for i in call) <= 2048 for call in calls), calls
    # No padding rows: a group is cut into batch buckets it fills exactly, largest first.
    fifteen = tuple(PrefillChunk(i, 0, (1, 2, 3)) for i in range(15))
    wide = ServingShapes.build(buckets, max_num_seqs=16, max_prefill_tokens=64)
    assert [len(c) for c in prefill_batches(fifteen, wide)] == [8, 4, 2, 1]
    assert sum(prefill_batches(fifteen, wide), []) == list(range(15))
    twelve = ServingShapes.build(buckets, max_num_seqs=12, max_prefill_tokens=64)
    assert twelve.prefill_batch_buckets(4) == (1, 2, 4, 8, 12)
    assert [len(c) for c in prefill_batches(fifteen, twelve)] == [12, 2, 1]
    inputs = prefill_inputs([chunks[i] for i in (0, 2, 3)], shapes, scratch_row=8, cache_slots=64)
    assert inputs.input_ids.shape == (4, 4) and inputs.read_slots == 64  # 3 chunks -> batch bucket 4
    assert inputs.rows.tolist() == [[0, 0, 0, 8], [2, 8, 8, 8], [3, 3, 8, 8], [8, 8, 8, 8]]
    assert inputs.cache_positions.tolist() == [[0, 1, 2, 0], [4, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    # padding columns repeat their row's last real position (filler rows: 0); cache writes unchanged
    assert inputs.position_ids.tolist() == [[0, 1, 2, 2], [4, 4, 4, 4], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert inputs.logit_index.tolist() == [2, 0, 1, 0]
    first_chunks = prefill_inputs([chunks[i] for i in (0, 3, 4)], shapes, scratch_row=8, cache_slots=64)
    assert first_chunks.read_slots == 4  # all start at slot 0: the call's width is all they can see


def test_the_plan_moves_no_more_prefill_tokens_than_a_step_can_hold():
    """The plan tensor every step (and idle heartbeat) all-reduces at TP > 1 had room for
    max_prefill_tokens tokens, which no step can fill when the chunks are smaller: 16384 (what
    `corelaunch bench` sets) with 512-token chunks and 4 rows moved 128 KB a step for 16 KB of use."""
    buckets = Buckets.build(max_seq_len=64, context=(4, 8), token=(32, 64))
    shapes = ServingShapes.build(buckets, max_num_seqs=4, max_prefill_tokens=16384)
    loop = ServingLoop(fresh_model(), ServingConfig(4, 16384, 64, shapes=shapes))
    assert shapes.max_chunk == 8
    # header 6, then (row, start, length, scored), (row, position, token), (row, slots) and (source, row,
    # slots) per row, then tokens
    assert loop.codec.empty().numel() == 6 + 12 * 4 + 4 * 8
    assert eager_loop(max_num_seqs=2, max_prefill_tokens=4).codec.empty().numel() == 6 + 12 * 2 + 4  # the budget


def test_a_compiled_model_makes_room_for_the_serving_shapes():
    """Static and serving shapes run through the same compiled functions; dynamo's per-function
    limit must hold both (workers/rank_worker.py reserves the serving ones before warming up)."""
    import torch._dynamo.config as dynamo_config

    from workers.compiled import CompiledCausalLM

    buckets = Buckets.build(max_seq_len=64, context=(4, 8), token=(32, 64))
    # Limits only grow: start low. (Dynamo's config module is saved and restored by hand, as
    # monkeypatch's undo deletes its keys.)
    saved = dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit
    dynamo_config.recompile_limit = dynamo_config.accumulated_recompile_limit = 1
    try:
        model = CompiledCausalLM(fresh_model(), buckets, announce=lambda line: None)
        assert dynamo_config.recompile_limit == len(buckets.shapes()) + 8
        shapes = ServingShapes.build(buckets, max_num_seqs=64, max_prefill_tokens=8)
        model.reserve_graphs(len(shapes.shapes()))
        assert dynamo_config.recompile_limit >= len(buckets.shapes()) + len(shapes.shapes())
        assert dynamo_config.fail_on_recompile_limit_hit
    finally:
        dynamo_config.recompile_limit = max(saved[0], dynamo_config.recompile_limit)
        dynamo_config.accumulated_recompile_limit = max(saved[1], dynamo_config.accumulated_recompile_limit)


def test_a_request_whose_token_choice_fails_fails_alone(monkeypatch):
    """Choosing one request's token raises after its neighbour drew (a stand-in for any such fault,
    e.g. NaN probabilities): that request ends with an "error" event and frees its row, the seeded
    neighbour keeps its own draws (each draw is seeded anew) and the greedy one its tokens, and the
    loop serves on. Failing the group instead would replay the request on the restarted group until
    the replica was given up (the adversarial run's top_k of 1e39 did that)."""
    import workers.serving.loop as loop_module

    sampled = SamplingParams(temperature=0.9, seed=77)
    loop = eager_loop(max_num_seqs=3, max_prefill_tokens=32)
    threads = run_loops([loop])
    loop.submit([request("a", PROMPTS[0], 6, sampling=sampled)])
    own_draws = collect(loop, {"a"}).tokens["a"]
    stop([loop], threads)

    real_choose = loop_module.choose

    def choose(logits, sequences):
        ids = [s.request.request_id for s in sequences]
        if "poisoned" in ids:
            before = ids.index("poisoned")
            real_choose(logits[:before], sequences[:before])  # the rows before it draw, then it fails
            raise OverflowError("cannot convert float infinity to integer")
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", choose)
    loop = eager_loop(max_num_seqs=3, max_prefill_tokens=32)
    threads = run_loops([loop])
    loop.submit([request("a", PROMPTS[0], 6, sampling=sampled), request("poisoned", PROMPTS[1], 6),
                 request("b", PROMPTS[2], 6)])
    got = collect(loop, {"a", "poisoned", "b"})
    assert got.finish["poisoned"] == "error" and got.tokens["poisoned"] == []
    [failed] = [e for e in got.events if e.request_id == "poisoned"]
    assert "OverflowError: cannot convert float infinity to integer" in failed.error
    assert got.tokens["a"] == own_draws and got.tokens["b"] == alone(tuple(PROMPTS[2]))[:6]
    loop.submit([request("after", PROMPTS[1], 3)])  # the loop still serves, in the freed row
    assert collect(loop, {"after"}).tokens["after"] == alone(tuple(PROMPTS[1]))[:3]
    stop([loop], threads)
    assert sorted(loop.scheduler.free_rows) == [0, 1, 2]


def test_a_choice_that_fails_for_every_row_fails_each_request_alone(monkeypatch):
    """Every row failing (prompts that share one bad setting) fails each request with its error; the
    loop itself serves on (failing the group would replay them until the replica was given up)."""
    import workers.serving.loop as loop_module

    real_choose = loop_module.choose

    def choose(logits, sequences):
        if any(s.request.request_id in ("a", "b") for s in sequences):
            raise RuntimeError("shared bad setting")
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", choose)
    loop = eager_loop(max_num_seqs=2, max_prefill_tokens=32)
    threads = run_loops([loop])
    loop.submit([request("a", PROMPTS[0], 4), request("b", PROMPTS[1], 4)])
    got = collect(loop, {"a", "b"})
    assert got.finish == {"a": "error", "b": "error"}
    loop.submit([request("after", PROMPTS[1], 3)])
    assert collect(loop, {"after"}).tokens["after"] == alone(tuple(PROMPTS[1]))[:3]
    stop([loop], threads)


def test_a_request_that_failed_on_nan_leaves_its_row_usable_for_the_next():
    """A forward that writes NaN keys and values (here a token whose embedding row is NaN) fails its
    request alone; its row's slots, reused without zeroing, poisoned every later request that read
    them through its mask (0 x NaN is NaN): with one row, every later short request failed."""
    hf = hf_model()
    state = hf_state_dict(hf)
    name = next(k for k in state if "embed_tokens" in k)
    state[name] = state[name].clone()
    state[name][127] = float("nan")
    model = build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), state, 0, 1, SingleRank())
    shapes = ServingShapes.build(Buckets.build(max_seq_len=32, context=(4, 8), token=(16, 32)), max_num_seqs=1,
                                 max_prefill_tokens=8)
    loop = ServingLoop(model, ServingConfig(1, 8, 32, shapes))
    threads = run_loops([loop])
    loop.submit([request("broken", [90, 14, 2, 127] + [8] * 12, 4)])
    failed = collect(loop, {"broken"})
    loop.submit([request("next", PROMPTS[1], 6)])
    got = collect(loop, {"next"})
    stop([loop], threads)
    assert failed.finish["broken"] == "error"
    assert got.finish["next"] == "length" and got.tokens["next"] == alone(tuple(PROMPTS[1]))[:6], got.events


def test_a_request_cancelled_mid_prefill_has_its_row_cleared_before_reuse():
    """Chunks before a prompt's last are never checked (no logits of theirs are read): a request
    cancelled between them may leave NaN behind, so its row comes back through a clearing plan."""
    sched = Scheduler(max_num_seqs=1, max_prefill_tokens=4, max_chunk=4)
    sched.add(Sequence(request("long", range(10), 4)))
    first = sched.schedule()
    assert [c.start for c in first.prefills] == [0] and first.clears == ()
    sched.running["long"].prefilled = 4  # what the loop records once the chunk ran (ServingLoop._choose)
    sched.cancel("long")  # after one chunk of three
    sched.add(Sequence(request("next", range(3), 4)))
    plan = sched.schedule()
    assert plan.clears == (ClearRow(0, 4 + 0 + 1),) and plan.prefills[0].row == 0
    sched.running["next"].prefilled = 3
    sched.cancel("next")  # prefilled whole (3 of 3): its logits were read, nothing left unchecked
    assert sched.rows_to_clear == [] and sched.free_rows == [0]
