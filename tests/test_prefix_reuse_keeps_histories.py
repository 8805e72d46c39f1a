"""Prefix caching once every row holds a history (workers/serving/prefix_reuse.py): a prompt sharing
only a system prompt with a conversation's row is copied into the row freed longest ago where that
row loses less, so the conversation's next turn still finds its whole history; the scheduler's slice-at-a-time view of a
running row's tokens; and the serving driver waiting past requests it was not asked about."""

from __future__ import annotations

import random

from tests.serving_driver import collect, request, run_loops, stop
from tests.test_engine import alone, fresh_model
from workers.serving import prefix_reuse, scheduler
from workers.serving.loop import ServingConfig, ServingLoop
from workers.serving.prefix_reuse import RowHistories, Seat, common_prefix_length
from workers.serving.scheduler import Scheduler, Sequence

MIN = prefix_reuse.MIN_SHARED_TOKENS
SYSTEM = tuple(range(100, 100 + 2 * MIN))  # a system prompt long enough to be shared
CONVERSATION = SYSTEM + tuple(range(1, 200))  # a conversation behind it: prompt and answers so far


def steady_histories() -> RowHistories:
    """Rows 1 and 2 hold unrelated histories (row 1 freed first), row 0 the conversation, freed last."""
    h = RowHistories()
    h.keep(1, tuple(range(300, 400)))
    h.keep(2, tuple(range(400, 500)))
    h.keep(0, CONVERSATION)
    return h


def test_without_a_blank_row_a_shared_prefix_is_copied_into_the_row_freed_longest_ago():
    h = steady_histories()
    other_turn = SYSTEM + (7, 7, 7)  # another conversation's first turn, behind the same system prompt
    # row 0 would lose 199 tokens of its conversation; row 1, freed longest ago, goes instead
    assert h.choose([0, 1, 2], other_turn, reuse=True) == Seat(1, len(SYSTEM), copy_from=0)
    assert h.choose([0, 1, 2, 3], other_turn, reuse=True) == Seat(3, len(SYSTEM), copy_from=0)  # a blank row first
    assert h.choose([0, 2], other_turn, reuse=True) == Seat(2, len(SYSTEM), copy_from=0)
    assert h.choose([0], other_turn, reuse=True) == Seat(0, len(SYSTEM))  # the only free row
    # the conversation's next turn, and the same prompt again, lose nothing of row 0: taken as it is
    assert h.choose([0, 1, 2], CONVERSATION + (5, 6), reuse=True) == Seat(0, len(CONVERSATION))
    assert h.choose([0, 1, 2], CONVERSATION, reuse=True) == Seat(0, len(CONVERSATION) - 1)
    # a past of fewer than MIN_SHARED_TOKENS beyond where they part is not worth another row's history
    short_tail = CONVERSATION[:-(MIN - 1)] + (9,)
    assert h.choose([0, 1, 2], short_tail, reuse=True) == Seat(0, len(short_tail) - 1)
    # MIN tokens of row 0's past against row 1's 100: the smaller loss, row 0's, is taken
    long_tail = CONVERSATION[:-MIN] + (9,)
    assert h.choose([0, 1, 2], long_tail, reuse=True) == Seat(0, len(long_tail) - 1)
    h.keep(1, tuple(range(300, 300 + MIN - 1)))  # shorter pasts, row 1 the one freed longest ago
    h.keep(2, tuple(range(400, 400 + MIN - 1)))
    h.keep(0, CONVERSATION)
    assert h.choose([0, 1, 2], long_tail, reuse=True) == Seat(1, len(long_tail) - 1, copy_from=0)


def test_rows_sharing_the_prompt_alike_seat_it_in_the_row_freed_longest_ago_with_no_copy():
    """Two rows share the system prompt alike: the prompt was copied from the lower into the row freed
    longest ago, which held those tokens already."""
    h = RowHistories()
    h.keep(1, SYSTEM + (1,) * 50)
    h.keep(0, SYSTEM + (2,) * 50)
    assert h.choose([0, 1], SYSTEM + (9,) * 20, reuse=True) == Seat(1, len(SYSTEM))
    # unless the other row's whole history is the prompt's start: seated there, nothing lost at all
    h.keep(0, SYSTEM)
    assert h.choose([0, 1], SYSTEM + (9,) * 20, reuse=True) == Seat(0, len(SYSTEM))


def test_a_row_of_another_salt_keeps_nothing_it_shares_with_the_prompt():
    """Its loss counted the system prompt it shares as kept, though after a copy those slots are the
    new salt's: 5 tokens lost against the source's 20, where it loses all its 37."""
    h = RowHistories()
    h.keep(1, SYSTEM + (1,) * 5, salt="theirs")  # freed longest ago
    h.keep(0, SYSTEM + (2,) * 20)
    assert h.choose([0, 1], SYSTEM + (9,) * 20, reuse=True) == Seat(0, len(SYSTEM))


def test_a_source_freed_longest_ago_loses_its_own_past_not_a_more_recent_row():
    h = RowHistories()
    h.keep(0, CONVERSATION)
    h.keep(1, tuple(range(300, 400)))
    h.keep(2, tuple(range(400, 500)))
    assert h.choose([0, 1, 2], SYSTEM + (7, 7, 7), reuse=True) == Seat(0, len(SYSTEM))
    # a running source has no history of its own to lose: its prefix goes into the row freed longest ago
    running = {3: (None, CONVERSATION)}
    h.forget(0)
    assert h.choose([1, 2], SYSTEM + (7, 7, 7), reuse=True, in_use=running) == Seat(1, len(SYSTEM), copy_from=3)


def test_a_conversation_keeps_its_history_when_a_request_sharing_its_system_prompt_comes_between_turns():
    """Every row holds a history when B, sharing only the system prompt with conversation A, comes:
    B takes the row freed longest ago, A's next turn reuses all its row held, and every answer
    equals its prompt run alone through the static engine."""
    system = tuple((i * 13 + 7) % 120 + 1 for i in range(20))
    loop = ServingLoop(fresh_model(), ServingConfig(3, 64, 128, prefix_caching=True))
    threads = run_loops([loop])

    def one(rid: str, prompt: tuple[int, ...]) -> tuple[list[int], int]:
        loop.submit([request(rid, prompt, 4)])
        got = collect(loop, {rid})
        [cached] = [e.cached_tokens for e in got.events if e.cached_tokens is not None]
        return got.tokens[rid], cached

    try:
        unrelated = [tuple(range(60, 80)), tuple(range(30, 50))]
        for n, prompt in enumerate(unrelated):
            one(f"u{n}", prompt)  # rows 0 and 1, u0's freed longest ago
        a_prompt = system + tuple(range(1, 30))
        a_out, _ = one("A", a_prompt)  # row 2: no blank row is left
        b_prompt = system + (5, 5, 5)
        b_out, b_cached = one("B", b_prompt)
        follow = a_prompt + tuple(a_out[:3]) + (9, 9)
        follow_out, follow_cached = one("A2", follow)
        _, u1_cached = one("u1 again", unrelated[1])
    finally:
        stop([loop], threads)
    assert b_cached == len(system) and b_out == alone(b_prompt)[:4]
    assert follow_cached == len(a_prompt) + 3, "A's row lost its history to B"  # its prompt and 3 tokens fed back
    assert follow_out == alone(follow)[:4]
    assert u1_cached == len(unrelated[1]) - 1  # B went into u0's row, freed longest ago, not u1's


def running_sequence(rng: random.Random, prompt_length: int) -> Sequence:
    """A running sequence as the loop leaves it: part or all of its prompt prefilled, maybe tokens chosen."""
    seq = Sequence(request("r", [rng.randrange(3) for _ in range(prompt_length)], 64))
    seq.prefilled = rng.randrange(prompt_length + 1)
    if seq.prefilled == prompt_length:
        seq.generated = rng.randrange(6)
        seq.output_ids = [rng.randrange(3) for _ in range(seq.generated)]
    return seq


def test_a_running_rows_tokens_read_slice_by_slice_are_its_written_tokens():
    rng = random.Random(3)
    for _ in range(300):
        seq = running_sequence(rng, rng.choice([1, 5, 70, 200]))
        written, view = scheduler._written(seq), scheduler._WrittenTokens(seq)
        assert len(view) == len(written)
        for _ in range(10):
            start, stop_at = rng.randrange(-3, len(written) + 4), rng.randrange(-3, len(written) + 4)
            assert view[start:stop_at] == written[start:stop_at], (start, stop_at, written)
        prompt = written[:rng.randrange(len(written) + 1)] + tuple(rng.randrange(3) for _ in range(rng.randrange(9)))
        assert common_prefix_length(view, prompt) == common_prefix_length(written, prompt)


def test_common_prefix_length_across_window_edges_and_of_lists_and_tuples():
    rng = random.Random(11)
    for _ in range(200):
        shared = rng.randrange(3000)
        a = [rng.randrange(1, 9) for _ in range(shared)] + [0] * rng.randrange(3)
        b = tuple(a[:shared]) + (99,) * rng.randrange(3)
        expected = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == expected == common_prefix_length(b, a), (shared, len(a), len(b))


def test_a_prompt_sharing_a_running_rows_prompt_and_tokens_copies_them_all():
    sched = Scheduler(max_num_seqs=2, max_prefill_tokens=64, max_chunk=64, prefix_caching=True)
    prompt = tuple(range(1, 2 * MIN))
    sched.add(Sequence(request("a", prompt, 8)))
    sched.schedule()
    a = sched.running["a"]
    a.prefilled, a.generated, a.output_ids = len(prompt), 3, [70, 71, 72]  # its row holds prompt, 70, 71
    sched.add(Sequence(request("b", prompt + (70, 71, 99), 4)))
    plan = sched.schedule()
    assert sched.running["b"].cached == len(prompt) + 2
    assert [(c.source, c.row, c.slots) for c in plan.copies] == [(a.row, sched.running["b"].row, len(prompt) + 2)]


def test_collect_waits_for_the_requests_asked_for_past_a_cancelled_one():
    loop = ServingLoop(fresh_model(), ServingConfig(2, 64, 128))
    threads = run_loops([loop])
    try:
        loop.submit([request("kept", (5, 9, 33, 17), 40), request("gone", (7, 100, 21), 40)])
        loop.cancel(["gone"])  # its abort comes long before "kept" has its 40 tokens
        got = collect(loop, {"kept"})
    finally:
        stop([loop], threads)
    assert got.finish.get("kept") == "length" and len(got.tokens["kept"]) == 40
