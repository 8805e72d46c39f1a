"""stream_interval through the driver API with the groups in-process (tests/in_process_cluster.py):
the leader holds a stream's tokens after its first until the interval has gathered, and the reader
gets the same tokens, text, log-probabilities and ends as with one token a delta, through stop
strings, cancels and a group fault (workers/serving/held_tokens.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from launcher.api import Launcher
from launcher.errors import WorkerDied
from tests.test_launcher_stream import thread_stream, tokens_of
from tests.test_replicas import EAGER, NEW_TOKENS, PROMPTS, model_and_expected  # noqa: F401 - fixture


def test_a_stream_interval_gathers_the_tokens_after_the_first(model_and_expected, in_process_cluster):
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, **EAGER) as llm:
        alone = list(llm.stream(PROMPTS[0], max_new_tokens=11, ignore_eos=True, logprobs=2))
        gathered = list(llm.stream(PROMPTS[0], max_new_tokens=11, ignore_eos=True, logprobs=2, stream_interval=3))
        assert llm.load() == {"running": 0, "waiting": 0}
    assert [len(d.token_ids) for d in alone] == [1] * 11
    assert [len(d.token_ids) for d in gathered] == [1, 3, 3, 3, 1]  # the end goes with what was held
    assert [t for d in gathered for t in d.token_ids] == [t for d in alone for t in d.token_ids]
    assert "".join(d.text for d in gathered) == "".join(d.text for d in alone)
    assert ([(p.token_id, p.logprob, p.top) for d in gathered for p in d.logprobs]
            == [(p.token_id, p.logprob, p.top) for d in alone for p in d.logprobs])
    assert gathered[0].time_to_first_token_s is not None and gathered[-1].completion_tokens == 11
    assert gathered[-1].finish_reason == "length"


def test_a_stream_with_stop_strings_is_gathered_by_its_reader_and_stops_where_it_would_have(
        model_and_expected, in_process_cluster, tmp_path):
    """Stop strings are matched on the driver: tokens the leader held would end the request up to
    stream_interval - 1 steps late, so the leader sends each and the stream gathers them by the
    same rule. It ends where it would have, its row free at once."""
    from tests.test_compile_cli import save_word_tokenizer

    model_dir, expected = model_and_expected
    with_words = Path(shutil.copytree(model_dir, tmp_path / "with-words"))
    save_word_tokenizer(with_words)  # "t0" .. "t127": the model's 128 ids
    stop = f" t{expected[0][2]} "  # complete with the fourth token (its leading space)
    with Launcher(model=str(with_words), tp=1, max_num_seqs=1, max_queued_requests=0, progress=False, **EAGER) as llm:
        alone = list(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True))
        stream = llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True, stream_interval=4)
        asked = list(stream)
        assert llm.load() == {"running": 0, "waiting": 0}
        unstopped = list(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True, stream_interval=4))
    assert asked[-1].finish_reason == "stop" and asked[-1].stopped_by_string
    assert [len(e.token_ids) for e in stream.events] == [1] * 4  # the leader sent each token
    assert [len(d.token_ids) for d in asked] == [1, 3]  # the first, then what came up to the stop
    assert [t for d in asked for t in d.token_ids] == [t for d in alone for t in d.token_ids]
    assert "".join(d.text for d in asked) == "".join(d.text for d in alone)
    assert asked[-1].completion_tokens == alone[-1].completion_tokens == 4
    assert [len(p.token_ids) for p in asked[-1].parts] == [1, 1, 1]
    assert [len(d.token_ids) for d in unstopped] == [1, 4, 1]  # without stop strings the leader holds them


def test_a_gathering_reader_gets_what_came_before_a_failure_then_the_failure():
    """A stream whose leader sent each token (stop strings) and that fails while its reader gathers:
    the tokens that came first are handed over, and the next read raises the failure."""
    from launcher.errors import RequestTimeout
    from workers.serving.requests import TokenEvent

    stream, handle = thread_stream(gather=4)
    for token in (5, 6, 7):
        handle.deliver(TokenEvent("r1", [token]))
    handle.fail(RequestTimeout("request r1 did not finish within 5 s; it was cancelled"))
    assert next(stream).token_ids == [5]
    assert next(stream).token_ids == [6, 7]
    with pytest.raises(RequestTimeout, match="did not finish within 5 s"):
        next(stream)


def test_a_gathering_reader_gets_an_error_of_its_own_reading_too_and_the_request_is_cancelled():
    """A failure that did not end the stream itself (reading a token's text failed) while its reader
    gathers: the tokens read before it are handed over, the next read raises it (no token after it
    is handed over as if nothing happened), and the request is cancelled."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    text = TextStream("r1", None, (), 2)
    read, cancelled = text.delta, []

    def failing_on_seven(event, *args):
        if event.token_ids == [7]:
            raise TypeError("token 7 has no text")
        return read(event, *args)

    text.delta = failing_on_seven
    stream, handle = thread_stream(text, lambda h, *args: cancelled.append(h.request_id), gather=4)
    for token in (5, 6, 7, 8, 9):  # the request still runs
        handle.deliver(TokenEvent("r1", [token]))
    assert next(stream).token_ids == [5]
    assert next(stream).token_ids == [6]
    with pytest.raises(TypeError, match="token 7 has no text"):
        next(stream)
    assert cancelled == ["r1"]


def test_a_bad_stream_interval_is_refused_before_anything_is_submitted(model_and_expected, in_process_cluster):
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, **EAGER) as llm:
        for value in (0, -2, True, "2", 2.5, None):
            with pytest.raises(ValueError, match=r"stream_interval \(.*\) must be an integer of at least 1"):
                llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stream_interval=value)
            assert llm.load() == {"running": 0, "waiting": 0}


def test_past_what_a_leader_holds_the_stream_gathers_on(model_and_expected, in_process_cluster):
    """A stream_interval above MOST_HELD: the leader holds at most MOST_HELD tokens an event (what a
    fault regenerates, what one event carries), and the stream gathers the events on a token at a
    time: the first token alone, then deltas of exactly the interval (an event split between two),
    the rest at the end (it had handed two events whole, 2 * MOST_HELD tokens a delta)."""
    from workers.serving.held_tokens import MOST_HELD

    model_dir, _ = model_and_expected
    new_tokens = 3 * MOST_HELD + 8
    # 100: the leader holds 50 (a divisor), so its events end where the deltas do; 101 and 193
    # (primes): it holds 64 (events of 1, 64, 64, 64 and the last 7), and the second delta ends
    # inside the second event of 64, or inside the last, whose rest then waits for the next read
    held = {100: [1, 50, 50, 50, 49], 101: [1] + [MOST_HELD] * 3 + [7], 193: [1] + [MOST_HELD] * 3 + [7]}
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, seq_len=512, progress=False, **EAGER) as llm:
        alone = list(llm.stream(PROMPTS[0], max_new_tokens=new_tokens, ignore_eos=True))
        read = []
        for interval in held:
            stream = llm.stream(PROMPTS[0], max_new_tokens=new_tokens, ignore_eos=True, stream_interval=interval)
            read.append((interval, stream, list(stream)))

        async def read_async(interval: int) -> tuple:
            stream = llm.astream(PROMPTS[0], max_new_tokens=new_tokens, ignore_eos=True, stream_interval=interval)
            return interval, stream, [d async for d in stream]

        read += [asyncio.run(read_async(interval)) for interval in held]
        for interval, stream, gathered in read:
            assert [len(e.token_ids) for e in stream.events] == held[interval]
            assert [len(d.token_ids) for d in gathered] == [1, interval, new_tokens - 1 - interval]
            assert [t for d in gathered for t in d.token_ids] == [t for d in alone for t in d.token_ids]
            assert "".join(d.text for d in gathered) == "".join(d.text for d in alone)
            assert [d.completion_tokens for d in gathered] == [1, 1 + interval, new_tokens]
            assert [len(p.token_ids) for d in gathered[1:] for p in d.parts] == [1] * (new_tokens - 1)
            assert gathered[-1].finish_reason == "length" and all(d.finish_reason is None for d in gathered[:-1])


def test_closing_a_stream_drops_the_tokens_it_carries_past_a_delta(model_and_expected, in_process_cluster):
    """Tokens read from a split event and not handed over yet end with a close: the reader that
    closed it reads its end quietly, as after any close."""
    from workers.serving.held_tokens import MOST_HELD

    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, seq_len=512, progress=False, **EAGER) as llm:
        # 101: the second delta ends inside the leader's second event of 64, the request still
        # running; 193: inside its last, the request finished (its end read, not handed over)
        for interval, new_tokens in ((101, 3 * MOST_HELD), (193, 3 * MOST_HELD + 8)):
            stream = llm.stream(PROMPTS[0], max_new_tokens=new_tokens, ignore_eos=True, stream_interval=interval)
            assert [len(next(stream).token_ids) for _ in range(2)] == [1, interval]
            stream.close()
            assert list(stream) == []
            assert llm.load() == {"running": 0, "waiting": 0}

        async def close_carrying() -> list:
            stream = llm.astream(PROMPTS[0], max_new_tokens=3 * MOST_HELD + 8, ignore_eos=True, stream_interval=193)
            assert [len((await anext(stream)).token_ids) for _ in range(2)] == [1, 193]
            await stream.aclose()
            return [d async for d in stream]

        assert asyncio.run(close_carrying()) == []


def test_closing_a_stream_with_held_tokens_frees_its_row(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, **EAGER) as llm:
        long = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True, stream_interval=64)
        next(long)
        waiting = llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS, stream_interval=64)
        long.close()
        assert long.handle.cancelled
        assert tokens_of(waiting) == (expected[1], "length")
        assert llm.load() == {"running": 0, "waiting": 0}


def test_a_group_fault_resumes_gathered_streams_without_a_lost_or_repeated_token(model_and_expected,
                                                                                   in_process_cluster):
    """Tokens the leader held when its group failed were never delivered: the resumed requests
    generate them again."""
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=2, progress=False, **EAGER) as llm:
        streams = [llm.stream(p, max_new_tokens=NEW_TOKENS, stream_interval=4) for p in PROMPTS]
        first = next(streams[0])
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        rest = [tokens_of(s) for s in streams]
        assert llm.replica_status()[0]["restarts"] == 1
    got = [(first.token_ids if i == 0 else []) + r[0] for i, r in enumerate(rest)]
    assert got == expected and all(finish == "length" for _, finish in rest)
    assert any(s.handle.attempts == 2 for s in streams)
