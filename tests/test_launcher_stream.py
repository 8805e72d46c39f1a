"""Launcher.stream / astream / agenerate / load with the groups in-process (tests/in_process_cluster.py):
streams equal generate's tokens, stop strings (cutting the text) and stop tokens end them, closing a stream cancels it
and frees its row, a full queue is refused, bad input fails before anything is submitted, and a
group fault mid-stream resumes every stream without a duplicated or missing token."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest

from launcher.api import Launcher
from launcher.errors import QueueFull, RequestCancelled, RequestFailed, RequestTimeout, WorkerDied
from tests.in_process_cluster import TokenGate
from tests.test_replicas import EAGER, NEW_TOKENS, PROMPTS, model_and_expected  # noqa: F401 - fixture


def tokens_of(stream) -> tuple[list[int], str | None]:
    tokens, finish = [], None
    for delta in stream:
        tokens.extend(delta.token_ids)
        finish = delta.finish_reason
    return tokens, finish


def test_streams_equal_generate_and_async_streams_too(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=2, progress=False, **EAGER) as llm:
        # requests that cannot end meanwhile, more than max_num_seqs: the load is read once
        held = [llm.stream(p, max_new_tokens=200, ignore_eos=True) for p in PROMPTS]
        assert llm.load() == {"running": 2, "waiting": len(PROMPTS) - 2}
        for stream in held:
            stream.close()
        streams = [llm.stream(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS]
        assert [tokens_of(s)[0] for s in streams] == expected
        start = time.monotonic()
        together = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        wall = time.monotonic() - start

        async def both():
            tokenized_on, tokenize = [], llm._tokenize

            def recording(prompts):  # agenerate tokenized on the loop, stalling its other coroutines
                tokenized_on.append(threading.get_ident())
                return tokenize(prompts)
            llm._tokenize = recording
            results = await llm.agenerate(PROMPTS, max_new_tokens=NEW_TOKENS)
            del llm._tokenize
            assert tokenized_on and threading.get_ident() not in tokenized_on
            collected = []
            async for delta in llm.astream(PROMPTS[0], max_new_tokens=NEW_TOKENS, logprobs=2):
                collected.append(delta)
            with pytest.raises(ValueError, match=r"return_logits \('no'\) must be True or False"):
                await llm.agenerate(PROMPTS, return_logits="no")
            return results, collected

        results, deltas = asyncio.run(both())
        assert llm.load() == {"running": 0, "waiting": 0}
    assert [r.token_ids for r in results] == expected
    # generate() reads its streams in turn; a first token is timed when it reached the driver, not
    # when generate() got round to reading it (which, for all but the first, is after the first ended).
    # Its later steps follow the first token, so each request's first token plus (at least half of)
    # its decode time fits in the call.
    assert [r.token_ids for r in together] == expected
    for r in together:
        assert r.time_to_first_token_s + 0.5 * sum(r.decode_step_latencies_s) <= wall, (r.time_to_first_token_s, wall)
    assert [t for d in deltas for t in d.token_ids] == expected[0]
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == NEW_TOKENS
    assert deltas[0].time_to_first_token_s is not None
    assert all(len(d.logprobs) == len(d.token_ids) and len(d.logprobs[0].top) == 2 for d in deltas if d.token_ids)


def test_closing_a_stream_cancels_it_and_frees_its_row(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, max_queued_requests=1, progress=False, **EAGER) as llm:
        long = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(long)
        waiting = llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)
        with pytest.raises(QueueFull, match="max_queued_requests 1") as info:
            llm.stream(PROMPTS[2], max_new_tokens=NEW_TOKENS)
        assert info.value.retry_after_s > 0
        long.close()  # its row goes to the waiting request
        assert long.handle.cancelled  # the cancel reached its replica (not only the stream's own end)
        assert tokens_of(waiting)[0] == expected[1]
        assert llm.load() == {"running": 0, "waiting": 0}

        # Ctrl-C while a reader waits for a token cancels the request too (it kept its row until
        # it ended or the stream was collected); the interrupt raised where the wait is
        interrupted = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(interrupted)

        def ctrl_c(*args, **kwargs):
            raise KeyboardInterrupt

        interrupted._items.get = ctrl_c
        with pytest.raises(KeyboardInterrupt):
            next(interrupted)
        assert interrupted.handle.cancelled and llm.load() == {"running": 0, "waiting": 0}


def test_a_stream_closed_by_another_reader_says_so_at_once(model_and_expected, in_process_cluster, monkeypatch):
    """A reader blocked in next() while another thread closes the stream (or in anext() while
    another task acloses it) waited its whole request timeout plus 30 s, then blamed the replica; a
    read after a cancel it did not ask for ended quietly, as a finished stream does."""
    import threading

    import workers.serving.loop as loop_module

    real_choose = loop_module.choose

    def slow_choose(logits, sequences):
        # the holder's 480 steps took ~0.7 s on a fast CPU, near the ~0.4 s of sleeps it must outlast
        # (a freed row lets the waiting reader get a token before its stream is closed): now >= 2.4 s
        time.sleep(0.005)
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", slow_choose)  # the groups are threads of this process
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, **EAGER) as llm:
        def hold():
            """A request holding the only row for a while (the model's whole context), its first token read."""
            holder = llm.stream(PROMPTS[0], max_new_tokens=480, ignore_eos=True)
            next(holder)
            return holder

        # a request waiting behind one that holds the only row: its reader blocks in next()
        holder = hold()
        blocked = llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)
        outcome = {}

        def read():
            try:
                next(blocked)
            except Exception as err:  # noqa: BLE001 - what the reader got is the test's subject
                outcome["error"] = err

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.2)
        blocked.close()
        reader.join(timeout=10)
        assert not reader.is_alive(), "the reader stayed blocked after another thread closed its stream"
        assert isinstance(outcome.get("error"), RequestCancelled)
        assert "was closed (close()) by another reader" in str(outcome["error"])
        with pytest.raises(StopIteration):  # the closing thread itself reads a quiet end
            next(blocked)
        holder.close()

        async def readers():
            holder = hold()
            waiting = llm.astream(PROMPTS[2], max_new_tokens=NEW_TOKENS)
            task = asyncio.create_task(waiting.__anext__())
            await asyncio.sleep(0.2)
            await waiting.aclose()
            with pytest.raises(RequestCancelled, match=r"was closed \(aclose\(\)\) by another reader"):
                await asyncio.wait_for(task, 10)
            # a read cut short (the task waiting in it cancelled, as asyncio.wait_for's timeout does)
            # cancels the request: later reads say so
            timed = llm.astream(PROMPTS[3], max_new_tokens=NEW_TOKENS)
            cut = asyncio.create_task(timed.__anext__())
            await asyncio.sleep(0.2)  # waiting in the read (the only row is held)
            cut.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cut
            with pytest.raises(RequestCancelled, match="when the task reading its stream was cancelled"):
                await timed.__anext__()
            holder.close()
            async with llm.astream(PROMPTS[4], max_new_tokens=200, ignore_eos=True) as scoped:
                await scoped.__anext__()
            assert scoped.handle.cancelled

        asyncio.run(readers())
        with llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True) as scoped:  # leaving the block closes it
            next(scoped)
        assert scoped.handle.cancelled
        # closing a stream whose request has finished, its end unread, ends it all the same (its
        # closer read the rest of the answer after the close); the request was not cancelled
        done = llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)
        while not done.handle.finished:
            time.sleep(0.01)
        done.close()
        assert tokens_of(done) == ([], None) and not done.handle.cancelled
        assert llm.load() == {"running": 0, "waiting": 0}


def test_a_generate_call_gets_a_request_timeout_per_wave_of_rows(model_and_expected, in_process_cluster):
    """Its prompts beyond the rows wait for one: each had only request_timeout_s from submission, so
    a call of more prompts than rows timed out on a healthy group where the static path answered.
    The waves are counted on the replica each prompt lands on, behind every request in flight there:
    counted as if the call had the rows to itself, a prompt queued behind another caller's stream
    (or, with replicas, all of a call's prompts on one while another restarts) timed out early."""
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, request_timeout_s=7, progress=False, **EAGER) as llm:
        streams, _, _ = llm._open_generation(PROMPTS, None, NEW_TOKENS, (), False, False, asynchronous=False)
        assert [s.handle.timeout_s for s in streams] == [7, 7, 14, 14, 21, 21]
        assert [tokens_of(s)[0] for s in streams] == expected
        other = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)  # another caller's, still running
        streams, _, _ = llm._open_generation(PROMPTS, None, NEW_TOKENS, (), False, False, asynchronous=False)
        assert [s.handle.timeout_s for s in streams] == [7, 14, 14, 21, 21, 28]
        assert other.handle.timeout_s == 7  # a stream of its own keeps one timeout
        other.close()
        assert [tokens_of(s)[0] for s in streams] == expected


def test_a_launcher_given_something_else_than_a_launch_config_says_so(model_and_expected):
    model_dir, _ = model_and_expected
    with pytest.raises(ValueError, match=r"config \('/.*'\) must be a LaunchConfig or None; pass options as "
                                         r"keywords, e\.g\. Launcher\(model=\.\.\.\)"):
        Launcher(str(model_dir))


def test_a_stream_garbage_collected_unread_is_cancelled_without_taking_a_lock(model_and_expected,
                                                                              in_process_cluster):
    """The collector may finalize a dropped stream on a thread holding the replica's lock (its
    thread, mid-poll): the finalizer must not take that lock again (a deadlock), yet the request
    is still cancelled and its row freed."""
    import gc
    import threading

    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, **EAGER) as llm:
        long = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(long)
        waiting = llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)
        lock = llm._pool.replicas[0]._streams_lock
        handle, streams = long.handle, [long]
        del long

        def drop_while_locked():
            with lock:
                streams.clear()
                gc.collect()

        dropper = threading.Thread(target=drop_while_locked, daemon=True)
        dropper.start()
        dropper.join(timeout=10)
        if dropper.is_alive():  # deadlocked on the lock it holds: free the replica so the test can end
            lock.release()
            pytest.fail("the dropped stream's finalizer took the replica's lock it was called under")
        assert tokens_of(waiting)[0] == expected[1]  # the long request's row went to it
        assert handle.cancelled  # cancelled by its finalizer, not run to its end
        assert llm.load() == {"running": 0, "waiting": 0}


@pytest.mark.parametrize("how", ["dropped", "closed"])
def test_a_dropped_or_closed_streams_late_cancel_spares_a_new_request_with_its_id(model_and_expected,
                                                                                 in_process_cluster, how):
    """A stream dropped unread leaves its cancel for the replica's next poll; one closed (or ended by
    a stop string) cancels at once. If its request has finished by then and a new one took its id,
    the cancel is the old request's: the new one runs on (closing cancelled it, 'abort')."""
    import gc

    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, progress=False, **EAGER) as llm:
        old = llm.stream(PROMPTS[0], max_new_tokens=3, ignore_eos=True, request_id="reused")
        deadline = time.monotonic() + 30
        while llm.load()["running"] and time.monotonic() < deadline:  # finished, its last delta unread
            time.sleep(0.01)
        assert llm.load() == {"running": 0, "waiting": 0}
        new = llm.stream(PROMPTS[1], max_new_tokens=100, ignore_eos=True, request_id="reused")
        first = next(new)
        replica, old_handle, cancels = llm._pool.replicas[0], old.handle, []
        real_cancel = replica.cancel_stream

        def recording(request_id, only=None):
            cancels.append((request_id, only))
            return real_cancel(request_id, only)

        replica.cancel_stream = recording
        if how == "closed":
            old.close()
        else:
            del old  # its finalizer leaves a cancel of "reused" for the replica's next poll
            gc.collect()
        tokens, finish = tokens_of(new)
        assert finish == "length" and len(first.token_ids) + len(tokens) == 100
        assert not new.handle.cancelled
        if how == "dropped":  # the cancel was made, by id, and held to the old request's handle
            assert cancels == [("reused", old_handle)]
        else:  # its request had ended: closing sends no cancel at all
            assert cancels == []


def test_a_stop_string_cuts_the_text_and_ends_the_request(model_and_expected, in_process_cluster, tmp_path):
    import shutil

    from tests.test_compile_cli import save_word_tokenizer

    model_dir, expected = model_and_expected
    with_words = Path(shutil.copytree(model_dir, tmp_path / "with-words"))
    save_word_tokenizer(with_words)  # "t0" .. "t127": the model's 128 ids
    # decoded after the prompt's last words (launcher/serving/detokenizer.py), the first word too
    # comes with the space the word decoder puts between words
    words = "".join(f" t{t}" for t in expected[0])
    stop = f" t{expected[0][2]} "  # the third token, surrounded: no other word contains it
    cut = words[:(words + " ").find(stop)]
    assert 0 < len(cut) < len(words)
    with Launcher(model=str(with_words), tp=1, max_num_seqs=1, max_queued_requests=0, progress=False, **EAGER) as llm:
        deltas = list(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True))
        # Out of the books the moment its reader saw the stop, not when the leader answers the
        # cancel: the next request is admitted at once (it was refused as a full queue meanwhile,
        # with no queue) and answered in full.
        assert llm.load() == {"running": 0, "waiting": 0}
        after = tokens_of(llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS))
        assert llm.load() == {"running": 0, "waiting": 0}
    assert "".join(d.text for d in deltas) == cut and deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens < NEW_TOKENS  # the stream ended at the stop, not at max_new_tokens
    assert after == (expected[1], "length")


def test_generation_config_eos_ids_end_requests_too(model_and_expected, in_process_cluster, tmp_path):
    """An end-of-turn id named only in generation_config.json (as Llama 3 Instruct's <|eot_id|>)
    ends a request as transformers' generate would; ignore_eos still runs past it, and a file that
    cannot be read is named before anything starts."""
    import json
    import shutil

    model_dir, expected = model_and_expected
    with_eos = Path(shutil.copytree(model_dir, tmp_path / "with-eos"))
    (with_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [expected[0][2]]}))
    with Launcher(model=str(with_eos), tp=1, progress=False, **EAGER) as llm:
        assert tokens_of(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS)) == (expected[0][:3], "stop")
        assert llm.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS)[0].token_ids == expected[0][:3]
        assert tokens_of(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True)) == (expected[0], "length")
    for text, words in (("{", "is not JSON"), ('{"eos_token_id": "2"}', "eos_token_id ('2') must be an integer")):
        (with_eos / "generation_config.json").write_text(text)
        with pytest.raises(ValueError, match=rf"generation_config.json.*{re.escape(words)}"):
            Launcher(model=str(with_eos), tp=1, progress=False, **EAGER).prepare()


def test_stop_tokens_end_a_stream_and_bad_options_are_refused(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, **EAGER) as llm:
        tokens, finish = tokens_of(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop_token_ids=[expected[0][2]]))
        assert tokens == expected[0][:3] and finish == "stop"
        import numpy as np
        import torch

        as_array = tokens_of(llm.stream(np.array(PROMPTS[0]), max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert as_array == (expected[0], "length")  # numpy's integers are token ids too
        # ... and counts (max_new_tokens and logprobs were refused "must be a positive integer")
        counted = llm.stream(PROMPTS[0], max_new_tokens=np.int64(NEW_TOKENS), ignore_eos=True, logprobs=np.int32(1))
        assert tokens_of(counted) == (expected[0], "length")
        for batching in ("continuous", "static"):
            [result] = llm.generate([PROMPTS[0]], max_new_tokens=np.int64(NEW_TOKENS), ignore_eos=True,
                                    batching=batching)
            assert result.token_ids == expected[0]
        # ... in generate() as well (refused there before), and torch's; not a tensor of bools
        arrays = [np.array(PROMPTS[0]), torch.tensor(PROMPTS[1]), list(np.array(PROMPTS[2], dtype=np.int32))]
        assert [r.token_ids for r in llm.generate(arrays, max_new_tokens=NEW_TOKENS)] == expected[:3]
        llm.check_prompts(arrays, max_new_tokens=NEW_TOKENS)
        with pytest.raises(ValueError, match=r"prompt \(tensor\(\[ True, False\]\)\) must be"):
            llm.stream(torch.tensor([True, False]))  # was taken as token ids 1, 0
        with pytest.raises(ValueError, match="prompts must be all strings or all lists of token ids"):
            llm.generate([torch.tensor([True, False])])
        with pytest.raises(ValueError, match="prompts must be all strings or all lists of token ids"):
            llm.generate([list(torch.tensor([True, False]))])  # 0-d bool tensors, one by one
        import array
        import collections

        for sized in (array.array("q", PROMPTS[0]), collections.deque(PROMPTS[0])):  # any sized sequence of ints
            assert tokens_of(llm.stream(sized, max_new_tokens=NEW_TOKENS, ignore_eos=True)) == (expected[0], "length")
        with pytest.raises(ValueError, match="logprobs"):
            llm.stream(PROMPTS[0], logprobs=21)
        with pytest.raises(ValueError, match="stop string"):
            llm.stream(PROMPTS[0], stop=[""])
        with pytest.raises(ValueError, match="max_new_tokens"):
            llm.stream(PROMPTS[0], max_new_tokens=0)
        with pytest.raises(ValueError, match=r"prompt \(\[\]\) must be"):
            llm.stream([])
        # a bare TypeError, numpy's "truth value of an array is ambiguous", and "no" read as True before
        for bad in (None, 5):
            with pytest.raises(ValueError, match=rf"prompts \({bad}\) must be a string, a list of strings"):
                llm.generate(bad)
        for flag in ("no", 0):
            with pytest.raises(ValueError, match=rf"ignore_eos \({flag!r}\) must be True or False"):
                llm.stream(PROMPTS[0], ignore_eos=flag)
            with pytest.raises(ValueError, match="ignore_eos"):
                llm.generate([PROMPTS[0]], ignore_eos=flag)
            for batching in ("continuous", "static"):  # "no" returned every token's logits
                with pytest.raises(ValueError, match=rf"return_logits \({flag!r}\) must be True or False"):
                    llm.generate([PROMPTS[0]], return_logits=flag, batching=batching)
        with pytest.raises(ValueError, match=r"batching \('bogus'\) must be 'continuous' or 'static'"):
            llm.check_prompts([PROMPTS[0]], batching="bogus")  # was checked as if static
        with pytest.raises(ValueError, match=r"prompt \(b'ab'\.\.\.\) is bytes; decode it"):
            llm.stream(b"ab")  # was taken as token ids 97, 98
        with pytest.raises(ValueError, match=r"prompts must be all strings or all lists of token ids; prompt 1 "
                                             r"\(\[5, True\]\) is neither$"):
            llm.generate([[5], [5, True]])  # was taken as [5, 1]
        with pytest.raises(ValueError, match=r"prompts \(\[5, 17, 42\]\) is one token-id list; pass a list of "
                                             r"prompts: \[\[5, 17, 42\]\]"):
            llm.generate([5, 17, 42])
        import numpy as np
        import torch
        for one_prompt in (np.array([5, 17, 42]), torch.tensor([5, 17, 42])):  # shown as [np.int64(5), ...]
            with pytest.raises(ValueError, match=r"prompts \(\[5, 17, 42\]\) is one token-id list; pass a list of "
                                                 r"prompts: \[\[5, 17, 42\]\]$"):
                llm.generate(one_prompt)
        with pytest.raises(ValueError, match=r"prompt 0 is a string but prompt 1 is a token-id list$"):
            llm.generate(["a", [5, 17]])
        with pytest.raises(ValueError, match=r"stop strings \(\['t1'\]\) need a tokenizer .* pass stop_token_ids"):
            llm.stream(PROMPTS[0], stop=["t1"])  # no tokenizer here: it was never matched
        with pytest.raises(ValueError, match=r"request_id \(\['x'\]\) must be a non-empty string"):
            llm.stream(PROMPTS[0], request_id=["x"])
        with pytest.raises(RuntimeError, match="inside an `async def`"):
            llm.astream(PROMPTS[0])
        assert llm.load() == {"running": 0, "waiting": 0}  # nothing bad was submitted


def test_the_queue_limit_admits_what_gets_a_row_and_a_generate_call_whole(model_and_expected, in_process_cluster):
    """max_queued_requests=0 refused every request, free rows or not; a generate() call with more
    prompts than rows was refused by its own prompts, leaving the ones submitted before running."""
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, max_queued_requests=0, progress=False, **EAGER) as llm:
        assert tokens_of(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS)) == (expected[0], "length")
        results = llm.generate(PROMPTS[:3], max_new_tokens=NEW_TOKENS)  # one row: two of them wait
        assert [r.token_ids for r in results] == expected[:3]
        long = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(long)
        with pytest.raises(QueueFull, match="max_queued_requests 0"):
            llm.generate(PROMPTS[1:3], max_new_tokens=NEW_TOKENS)
        assert llm.load() == {"running": 1, "waiting": 0}  # none of the refused call's prompts was submitted
        long.close()


def test_a_group_fault_mid_stream_resumes_every_stream(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=1, progress=False, **EAGER) as llm:
        streams = [llm.stream(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS]
        first = next(streams[0])  # one row: the first streams, the others wait
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        rest = [tokens_of(s) for s in streams]
        status = llm.replica_status()[0]
    got = [(first.token_ids if i == 0 else []) + r[0] for i, r in enumerate(rest)]
    assert got == expected
    assert status["restarts"] == 1
    assert sum(s.handle.attempts == 2 for s in streams) >= len(PROMPTS) - 1


def test_a_stream_closed_while_its_group_restarts_leaves_the_books_at_once(model_and_expected, in_process_cluster):
    """No leader will answer its cancel: it was counted (and its id held) until the restart ended."""
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, max_queued_requests=0, progress=False, **EAGER) as llm:
        closed = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True, request_id="closed")
        next(closed)
        pool = llm._pool
        make_group, seen = pool._make_group, {}

        def close_meanwhile(index, restart):
            closed.close()
            seen["load"] = llm.load()
            again = llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS, request_id="closed")  # its id is free
            seen["again"] = again
            return make_group(index, restart)

        pool._make_group = close_meanwhile
        llm._group.fail_next(WorkerDied("rank 0 (in-process) died while serving"))
        deadline = time.monotonic() + 60
        while "again" not in seen:
            assert time.monotonic() < deadline, "the group was never restarted"
            time.sleep(0.05)
        assert seen["load"] == {"running": 0, "waiting": 0}
        assert tokens_of(seen["again"]) == (expected[1], "length")
        assert llm.load() == {"running": 0, "waiting": 0}


def test_starting_a_running_launcher_again_starts_nothing(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, **EAGER).start() as llm:  # __enter__ starts it again
        assert llm.start() is llm
        assert llm.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS)[0].token_ids == expected[0]
    assert len(in_process_cluster.groups) == 1  # placed a second group beside the first before


def leader_that_can_hang(monkeypatch):
    """(hang, release): while hang is set, the serving leader blocks in its token choice (a rank
    stuck in a step, its keepalives still flowing) until release is set."""
    import threading

    import workers.serving.loop as loop_module

    real_choose, hang, release = loop_module.choose, threading.Event(), threading.Event()

    def choose(logits, sequences):
        if hang.is_set():
            release.wait(120)
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", choose)
    return hang, release


def restart_causes(monkeypatch) -> list[str]:
    """The causes the replicas' groups are restarted for, in order (recorded before the restart counts)."""
    from launcher.cluster.replica_pool import Replica

    causes, real_restart = [], Replica._restart

    def restart(self, cause):
        causes.append(str(cause))
        return real_restart(self, cause)

    monkeypatch.setattr(Replica, "_restart", restart)
    return causes


def judged_hung_at_the_timeout(monkeypatch):
    """(hang, release, causes): a serving leader that can hang (leader_that_can_hang), a group judged
    hung at the request timeout itself (no 30 s floor), and the causes of its restarts."""
    hang, release = leader_that_can_hang(monkeypatch)
    monkeypatch.setattr("launcher.cluster.replica_pool.HUNG_AFTER_AT_LEAST_S", 0.0)
    return hang, release, restart_causes(monkeypatch)


def generate_on_a_thread(llm, prompts):
    """(the thread, the errors its generate() raised): 4 new tokens a prompt, run in the background."""
    import threading

    failed = []

    def run():
        try:
            llm.generate(prompts, max_new_tokens=4)
        except Exception as err:  # noqa: BLE001 - the caller checks it
            failed.append(err)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    return caller, failed


def replaced_as_hung_after(llm, causes: list[str], limit: str, deadline: float) -> None:
    """Wait (until the monotonic `deadline`) for replica 0's group to be restarted, and check it was
    judged hung after `limit` ("2 s"): the restart cause names the limit it was judged by."""
    while llm.replica_status()[0]["restarts"] < 1:
        assert time.monotonic() < deadline, "the hung group was never replaced"
        time.sleep(0.05)
    assert causes and f"group made no step in {limit} (the request timeout)" in causes[0], causes


def test_a_group_that_makes_no_step_while_a_request_times_out_is_replaced(model_and_expected, in_process_cluster,
                                                                           monkeypatch):
    """A leader stuck in a step (a device wait, say) while its keepalives flow: the request timed out,
    the group stayed, and, counting no stream, looked the least loaded and got every request after."""
    from launcher.errors import RequestTimeout

    hang, release = leader_that_can_hang(monkeypatch)
    monkeypatch.setattr("launcher.cluster.replica_pool.HUNG_AFTER_AT_LEAST_S", 0.0)  # judged at the timeout
    model_dir, expected = model_and_expected
    try:
        with Launcher(model=model_dir, tp=1, progress=False, request_timeout_s=1, **EAGER) as llm:
            hang.set()
            with pytest.raises(RequestTimeout):
                tokens_of(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS))
            hang.clear()  # the next group's leader steps as usual
            deadline = time.monotonic() + 60
            while llm.replica_status()[0]["restarts"] < 1:
                assert time.monotonic() < deadline, "the hung group was never replaced"
                time.sleep(0.05)
            assert tokens_of(llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)) == (expected[1], "length")
    finally:
        release.set()


def test_a_hung_group_is_replaced_even_when_every_client_gives_up_before_its_timeout(
        model_and_expected, in_process_cluster, monkeypatch):
    """Clients that close their streams before request_timeout_s (an HTTP client's own timeout)
    left no late request to judge the group by: a leader stuck in a step was never replaced, kept
    taking every request, and their cancels stayed unanswered. The group is judged by whether its
    leader steps while it has work."""
    hang, release = leader_that_can_hang(monkeypatch)
    monkeypatch.setattr("launcher.cluster.replica_pool.HUNG_AFTER_AT_LEAST_S", 0.0)  # judged at the timeout
    causes = restart_causes(monkeypatch)
    model_dir, expected = model_and_expected
    try:
        with Launcher(model=model_dir, tp=1, progress=False, request_timeout_s=2, **EAGER) as llm:
            first = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
            next(first)
            hang.set()
            hung_at = time.monotonic()
            first.close()  # each client gives up well before its 2 s
            while llm.replica_status()[0]["restarts"] < 1:
                assert time.monotonic() - hung_at < 30, "the hung group was never replaced"
                stream = llm.stream(PROMPTS[1], max_new_tokens=4)
                time.sleep(0.5)
                stream.close()
            hang.clear()
            # replaced by the hung-group check after one request timeout (the cause names the limit,
            # where a wall-clock bound was at the mercy of a loaded machine)
            assert causes and "group made no step in 2 s (the request timeout)" in causes[0], causes
            assert tokens_of(llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)) == (expected[1], "length")
    finally:
        release.set()


def test_a_hung_group_is_noticed_within_the_first_waves_timeout(model_and_expected, in_process_cluster,
                                                                 monkeypatch):
    """generate() gives its later waves of rows longer timeouts; the hung-group check took the last
    stream's, so with four waves a hung group was replaced after four timeouts, not one."""
    hang, release, causes = judged_hung_at_the_timeout(monkeypatch)
    model_dir, _ = model_and_expected
    try:
        with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, request_timeout_s=2, **EAGER) as llm:
            hang.set()
            start = time.monotonic()
            caller, failed = generate_on_a_thread(llm, PROMPTS[:4])
            # judged on the first wave's 2 s timeout, not the last wave's 8 s (the cause names the limit,
            # where a wall-clock bound was at the mercy of a loaded machine)
            replaced_as_hung_after(llm, causes, "2 s", start + 30)
            hang.clear()
            caller.join(60)
            assert failed, "generate() should have failed: its first wave timed out in the hung group"
    finally:
        release.set()


def test_a_step_slower_than_the_request_timeout_times_the_request_out_but_keeps_the_group(
        model_and_expected, in_process_cluster, monkeypatch):
    """A long prompt's prefill outlasting a short request timeout was judged a hung group: the group
    was restarted (a restart counted) for each such request, and after the restart limit given up,
    every later request refused. The request times out; the group goes on serving."""
    import workers.serving.loop as loop_module
    from launcher.errors import RequestTimeout

    real_choose, slow = loop_module.choose, []

    def choose(logits, sequences):
        if not slow:
            slow.append(True)
            time.sleep(3)  # one step three times the request timeout: slow, not stuck
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", choose)
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, request_timeout_s=1, max_restarts=1, **EAGER) as llm:
        for _ in range(2):  # the first slow, the second waits behind it: both time out
            with pytest.raises(RequestTimeout):
                tokens_of(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS))
        time.sleep(2.5)  # the slow step ends; a hung-group check would have fired by now
        assert llm.replica_status()[0]["restarts"] == 0
        assert tokens_of(llm.stream(PROMPTS[1], max_new_tokens=NEW_TOKENS)) == (expected[1], "length")


def test_streams_are_read_between_queued_static_batches(model_and_expected, in_process_cluster, monkeypatch):
    """A serving group's replica ran every queued static batch before it read its streams again: a
    stream's tokens (and its deadline, and cancels) waited for the whole backlog (13 s on a busy
    machine). Now it reads them after each one, the rest still queued."""
    from launcher.cluster.replica_pool import Replica

    timeline = []
    real_serve, real_poll = Replica._serve, Replica._poll_streams

    def serve(self, item):
        timeline.append("static")
        return real_serve(self, item)

    def poll(self, *args, **kwargs):
        timeline.append(("poll", self.pool._queue.qsize()))
        return real_poll(self, *args, **kwargs)

    monkeypatch.setattr(Replica, "_serve", serve)
    monkeypatch.setattr(Replica, "_poll_streams", poll)
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, max_batch_size=1, progress=False, **EAGER) as llm:
        stream = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(stream)
        llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(6)], max_new_tokens=4, batching="static")
        stream.close()
    first, last = timeline.index("static"), len(timeline) - timeline[::-1].index("static") - 1
    between = [entry for entry in timeline[first:last] if entry != "static"]
    assert any(queued > 0 for _, queued in between), timeline  # read with static batches still waiting


def test_a_stream_past_its_deadline_when_its_group_restarts_times_out_rather_than_resuming(
        model_and_expected, in_process_cluster):
    """Resuming it would prefill its prompt and tokens again, only for it to time out at the next poll."""
    from launcher.errors import RequestTimeout

    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=2, progress=False, **EAGER) as llm:
        overdue = llm.stream(PROMPTS[0], max_new_tokens=500, ignore_eos=True)
        on_time = llm.stream(PROMPTS[1], max_new_tokens=200, ignore_eos=True)
        next(overdue)
        pool = llm._pool
        make_group = pool._make_group

        def make_group_later(index, restart):  # the restart took longer than the request had left
            overdue.handle.deadline = time.monotonic() - 1
            return make_group(index, restart)

        pool._make_group = make_group_later
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        with pytest.raises(RequestTimeout, match="its group failed and it was not resumed"):
            tokens_of(overdue)
        tokens, finish = tokens_of(on_time)  # the other stream resumed, and ended whole
        assert finish == "length" and len(tokens) == 200 and tokens[:len(expected[1])] == expected[1]
        assert llm.replica_status()[0]["restarts"] == 1
        assert overdue.handle.attempts == 1 and on_time.handle.attempts == 2
        assert llm.load() == {"running": 0, "waiting": 0}


def test_a_seeded_sampled_stream_resumed_after_a_fault_draws_what_it_would_have(model_and_expected,
                                                                                 in_process_cluster):
    """Each draw is seeded from the request's seed and the draw's number, so the restarted group's
    draws go on where the stream stopped (it restarted the request's generator, drawing token 6
    with token 1's randomness)."""
    from workers.sampling import SamplingParams

    model_dir, _ = model_and_expected
    sampled = SamplingParams(temperature=1.0, seed=5)
    new_tokens = 64  # many more than arrive between the first token and the fault
    with Launcher(model=model_dir, tp=2, progress=False, **EAGER) as llm:
        clean = tokens_of(llm.stream(PROMPTS[0], sampled, max_new_tokens=new_tokens, ignore_eos=True))[0]
        stream = llm.stream(PROMPTS[0], sampled, max_new_tokens=new_tokens, ignore_eos=True)
        first = next(stream)
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        rest = tokens_of(stream)[0]
        assert llm.replica_status()[0]["restarts"] == 1 and stream.handle.attempts == 2
    assert first.token_ids + rest == clean and len(clean) == new_tokens


def test_a_request_whose_token_choice_fails_is_failed_alone(model_and_expected, in_process_cluster, monkeypatch):
    """The leader's token choice raises for one request (seed 13): the caller gets RequestFailed
    naming why, the greedy streams beside it finish with their tokens, and the group is not
    restarted (a restart would replay the request and fail again, until the replica was given up)."""
    import workers.serving.loop as loop_module
    from workers.sampling import SamplingParams

    real_choose = loop_module.choose

    def choose(logits, sequences):
        if any(s.request.sampling.seed == 13 for s in sequences):
            raise OverflowError("cannot convert float infinity to integer")
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", choose)
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=3, progress=False, **EAGER) as llm:
        streams = [llm.stream(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS[:2]]
        poisoned = llm.stream(PROMPTS[2], SamplingParams(temperature=0.7, seed=13), max_new_tokens=NEW_TOKENS)
        with pytest.raises(RequestFailed, match="OverflowError: cannot convert float infinity to integer"):
            tokens_of(poisoned)
        assert [tokens_of(s)[0] for s in streams] == expected[:2]
        assert llm.generate([PROMPTS[2]], max_new_tokens=NEW_TOKENS)[0].token_ids == expected[2]
        status = llm.replica_status()[0]
        assert llm.load() == {"running": 0, "waiting": 0}
    assert status["restarts"] == 0


def test_a_request_its_group_drops_unasked_fails_rather_than_ending(model_and_expected, in_process_cluster,
                                                                    monkeypatch):
    """The group answers "abort" for a request it drops without being asked (here its scheduler
    refuses the submission). The reader got a last delta with finish_reason "abort", no reason a
    delta documents, which the HTTP server passed on to OpenAI clients; it now gets RequestCancelled."""
    from workers.serving.scheduler import Scheduler

    def refuse(self, sequence):
        raise ValueError("refused for the test")

    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, progress=False, **EAGER) as llm:
        monkeypatch.setattr(Scheduler, "add", refuse)
        stream = llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        with pytest.raises(RequestCancelled, match="aborted by its TP group"):
            tokens_of(stream)
        assert llm.load() == {"running": 0, "waiting": 0}


def test_decode_rate_and_step_times_count_the_whole_step_not_the_forward_alone(model_and_expected, in_process_cluster,
                                                                                monkeypatch):
    """A request's decode rate and step latencies are the time between its tokens (planning, forward
    and token choice), as the static engine's are: with token choice slowed to 50 ms a step, no
    step can be shorter and the rate cannot pass 20 tokens/s (they were the forward's time alone)."""
    import workers.serving.loop as serving_loop

    choose = serving_loop.choose

    def slow_choose(*args, **kwargs):
        time.sleep(0.05)
        return choose(*args, **kwargs)

    monkeypatch.setattr(serving_loop, "choose", slow_choose)
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=2, max_num_seqs=2, progress=False, **EAGER) as llm:
        [result] = llm.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS)
    assert result.token_ids == expected[0]
    times = result.token_times_s
    assert len(times) == NEW_TOKENS and len(result.decode_step_latencies_s) == NEW_TOKENS - 1
    assert min(result.decode_step_latencies_s) >= 0.05, result.decode_step_latencies_s
    assert result.decode_step_latencies_s == pytest.approx([b - a for a, b in zip(times, times[1:])])
    assert result.decode_tokens_per_s == pytest.approx((NEW_TOKENS - 1) / (times[-1] - times[0]))
    assert result.decode_tokens_per_s <= 20.0


def test_a_resumed_requests_decode_rate_leaves_the_restart_out(model_and_expected, in_process_cluster,
                                                             monkeypatch):
    """A stream resumed on a restarted group: the gap into its first resumed token is the restart
    (staged here at 5 s), timed across two leaders' clocks; it counted as a decode step (2.1 s of 5
    with a 2 s restart). The restart is longer than any bound below, so a step stalled a second or
    two on a loaded machine passes and a counted restart still fails."""
    from launcher.errors import WorkerDied

    restart_s = 5.0  # longer than either bound below: a counted restart cannot pass them
    model_dir, expected = model_and_expected
    gate = TokenGate(monkeypatch, after=2)  # the stream is still running when the fault is set
    with Launcher(model=model_dir, tp=2, max_num_seqs=1, progress=False, **EAGER) as llm:
        make = llm._pool._make_group

        def slow_make(*args, **kwargs):
            time.sleep(restart_s)
            return make(*args, **kwargs)

        llm._pool._make_group = slow_make
        stream = llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        next(stream)
        next(stream)
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        gate.release()
        tokens = [t for delta in stream for t in delta.token_ids]
        result = llm._result(stream, None, list(PROMPTS[0]))
    assert result.attempts == 2 and result.token_ids == expected[0], (result.attempts, result.token_ids, tokens)
    resumed = stream.handle.resumed_at
    assert resumed and 0 < resumed[0] < NEW_TOKENS
    assert len(result.decode_step_latencies_s) == NEW_TOKENS - 2  # every gap but the one into the resumed token
    assert max(result.decode_step_latencies_s) < 3.0, result.decode_step_latencies_s
    # the restart counted: 5 steps over more than restart_s (5 s), under 1 token/s
    assert result.decode_tokens_per_s > 1.0, (result.decode_tokens_per_s, result.decode_step_latencies_s)


def test_an_async_stream_read_on_another_event_loop_is_refused_at_once(model_and_expected, in_process_cluster):
    """Its events go to the loop astream() was called on: read on another, the reader waited out the
    request timeout plus 30 s and then blamed the replica."""
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, request_timeout_s=3, **EAGER) as llm:
        async def make():
            return llm.astream(PROMPTS[0], max_new_tokens=4)

        async def read(stream):
            return [delta async for delta in stream]

        stream = asyncio.run(make())
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="call astream\\(\\) in the loop that reads the stream"):
            asyncio.run(read(stream))
        assert time.monotonic() - start < 2
        deadline = time.monotonic() + 10  # the refused request was cancelled, its row freed
        while llm.load() != {"running": 0, "waiting": 0}:
            assert time.monotonic() < deadline, llm.load()
            time.sleep(0.05)


@pytest.mark.parametrize("gather", [1, 2])
def test_a_stream_closed_after_its_request_finished_unread_reads_its_end_quietly(gather):
    """A review: the request had finished on its group (nothing left to cancel) with deltas unread;
    close() left them, and the reader that closed the stream read the rest of the answer after it.
    Its closer now reads a quiet end, as after a running request's close; another reader gets why."""
    from workers.serving.requests import TokenEvent

    for closing in ("sync", "async"):
        stream, handle = thread_stream(gather=gather) if closing == "sync" else async_stream(gather)
        for token, finish in ((5, None), (6, None), (7, None), (8, "length")):
            handle.deliver(TokenEvent("r1", [token], finish))
        if closing == "sync":
            assert next(stream).token_ids == [5]
            stream.close()
            assert list(stream) == []
            outcome: dict = {}
            other = threading.Thread(target=lambda: outcome.setdefault("error", _next_error(stream)))
            other.start()
            other.join(10)
            assert isinstance(outcome["error"], RequestCancelled)
        else:
            async def close_then_read() -> list:
                assert (await anext(stream)).token_ids == [5]
                await stream.aclose()
                return [d async for d in stream]

            assert asyncio.run(close_then_read()) == []


def _next_error(stream) -> BaseException | None:
    try:
        next(stream)
    except BaseException as err:  # noqa: BLE001 - returned for the test to check
        return err
    return None


def async_stream(gather: int = 1):
    """(an AsyncRequestStream of request r1, not tied to an event loop, joining `gather` tokens a
    delta, and its StreamHandle, which delivers events to its queue)."""
    from launcher.cluster.stream_handle import StreamHandle
    from launcher.serving.request_streams import AsyncRequestStream
    from launcher.serving.text_stream import TextStream
    from shardlib.sampling_params import SamplingParams
    from workers.serving.requests import StreamRequest

    items = asyncio.Queue()
    handle = StreamHandle(StreamRequest("r1", (1, 2), SamplingParams(), 10), items.put_nowait, 5.0)
    return AsyncRequestStream(lambda *args, **kwargs: None, handle, TextStream("r1", None, (), 2), items,
                              gather=gather), handle


def thread_stream(text=None, cancel=None, gather: int = 1):
    """(a RequestStream of request r1, read on threads, joining `gather` tokens a delta, and its
    StreamHandle, which delivers events to it)."""
    import queue

    from launcher.cluster.stream_handle import StreamHandle
    from launcher.serving.request_streams import RequestStream, thread_sink
    from launcher.serving.text_stream import TextStream
    from shardlib.sampling_params import SamplingParams
    from workers.serving.requests import StreamRequest

    items = queue.Queue()
    handle = StreamHandle(StreamRequest("r1", (1, 2), SamplingParams(), 10), thread_sink(items), 5.0)
    stream = RequestStream(cancel or (lambda *args, **kwargs: None), handle, text or TextStream("r1", None, (), 2),
                           items, gather=gather)
    return stream, handle


def test_a_failed_stream_gives_its_error_to_every_later_reader_not_a_quiet_end():
    """A request its replica failed (a timeout, a replica given up) raised the error for the read
    that met it; another thread's read after that ended quietly, as a finished answer does."""
    import threading

    from launcher.errors import RequestTimeout
    from workers.serving.requests import TokenEvent

    stream, handle = thread_stream()
    handle.deliver(TokenEvent("r1", [5]))
    assert next(stream).token_ids == [5]
    handle.fail(RequestTimeout("request r1 did not finish within 5 s; it was cancelled"))
    seen = []

    def read() -> None:
        try:
            seen.append(next(stream))
        except BaseException as err:  # noqa: BLE001 - what the reader got is the test
            seen.append(err)

    for _ in range(2):  # the first reader meets the error, the second comes after it
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(5)
    assert [type(e) for e in seen] == [RequestTimeout, RequestTimeout], seen
    assert "did not finish within 5 s" in str(seen[1])


def test_agenerate_cancelled_as_it_submits_cancels_every_request(model_and_expected, in_process_cluster,
                                                                 monkeypatch):
    """A cancel landing in the loop turn that submitted the requests cancels agenerate's drains
    before they first run: nothing read the streams, so nothing cancelled them, and a caller that
    kept the cancelled task (its exception holding agenerate's frame) kept them running on."""
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=2, progress=False, **EAGER) as llm:
        opened = llm._open_generation

        def then_cancelled(*args, **kwargs):  # the caller's cancel arrives as the requests go out
            out = opened(*args, **kwargs)
            asyncio.current_task().cancel()
            return out
        monkeypatch.setattr(llm, "_open_generation", then_cancelled)

        async def cancelled_agenerate():
            task = asyncio.create_task(llm.agenerate(PROMPTS[:2], max_new_tokens=120, ignore_eos=True))
            await asyncio.wait([task])  # waited on, not awaited: the task keeps its exception
            assert task.cancelled()
            return task, llm.load()

        task, load = asyncio.run(cancelled_agenerate())
        assert load == {"running": 0, "waiting": 0}
        del task


def test_a_hung_group_is_noticed_within_one_timeout_when_a_calls_prompts_queued_behind_others(
        model_and_expected, in_process_cluster, monkeypatch):
    """generate()'s prompts queued behind another caller's request get a timeout per wave ahead of
    them, its first prompts too; the hung-group check took the shortest of those, so once the other
    request had gone, a hang was noticed only after two timeouts. It judges each request's own."""
    hang, release, causes = judged_hung_at_the_timeout(monkeypatch)
    model_dir, _ = model_and_expected
    try:
        with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, request_timeout_s=2, **EAGER) as llm:
            other = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
            caller, _ = generate_on_a_thread(llm, PROMPTS[:2])  # a hung group's requests fail; the cause is checked
            start = time.monotonic()
            while llm.load()["running"] + llm.load()["waiting"] < 3:
                assert time.monotonic() - start < 30, "generate's prompts never arrived"
                time.sleep(0.01)
            other.close()  # the other caller's request goes: only the call's, with 4 s and 6 s, are left
            hang.set()
            replaced_as_hung_after(llm, causes, "2 s", start + 60)
            hang.clear()
            caller.join(60)
    finally:
        release.set()


def test_a_request_waiting_behind_a_long_one_moves_to_the_replica_that_came_free(model_and_expected,
                                                                                 in_process_cluster):
    """One row per replica: the third request goes where the long one runs (both replicas had one
    request), and waited there for its whole length while the other replica's short request ended
    and left it idle. It now moves there, and runs, and is answered, once."""
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, replicas=2, max_num_seqs=1, progress=False, **EAGER) as llm:
        long = llm.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        short = llm.stream(PROMPTS[1], max_new_tokens=2)
        waiting = llm.stream(PROMPTS[2], max_new_tokens=NEW_TOKENS)
        assert [s.handle.replica for s in (long, short, waiting)] == [0, 1, 0]
        assert tokens_of(short)[0] == expected[1][:2]
        tokens, finish = tokens_of(waiting)  # within the long request's 200 tokens
        assert not long.handle.finished, "the long request ended first: this test shows nothing"
        assert tokens == expected[2] and len(waiting.handle.delivered) == len(expected[2])
        assert waiting.handle.replica == 1 and waiting.handle.attempts == 1
        long.close()
        # the moved id and the closed one are answered on replica 0: nothing is owed, nothing runs
        deadline = time.monotonic() + 10
        while any(r.cancelling for r in llm._pool.replicas) or llm.load() != {"running": 0, "waiting": 0}:
            assert time.monotonic() < deadline, ([r.cancelling for r in llm._pool.replicas], llm.load())
            time.sleep(0.01)


# ---- the text a failed stream held back, and the reader's own wait --------------------------------
HELD_TEXT = "Hello world, this is END"
"""Its last token's text, " END", may begin the stop string "END!": held back until a later token."""


def stream_with_a_stop_string(tokenizer, gather: int = 1, asynchronous: bool = False):
    """(a stream of request r1 whose text stops at "END!", its StreamHandle, its queue)."""
    import queue

    from launcher.cluster.stream_handle import StreamHandle
    from launcher.serving.request_streams import AsyncRequestStream, RequestStream, thread_sink
    from launcher.serving.text_stream import TextStream
    from shardlib.sampling_params import SamplingParams
    from workers.serving.requests import StreamRequest

    text = TextStream("r1", tokenizer, ("END!",), 2)
    items = asyncio.Queue() if asynchronous else queue.Queue()
    handle = StreamHandle(StreamRequest("r1", (1, 2), SamplingParams(), 10),
                          items.put_nowait if asynchronous else thread_sink(items), 5.0)
    kind = AsyncRequestStream if asynchronous else RequestStream
    return kind(lambda *args, **kwargs: None, handle, text, items, gather=gather), handle


def read_until_it_fails(stream, asynchronous: bool) -> tuple[str, list[int], BaseException | None]:
    """(the text and tokens of every delta read, and the error the read after them raised)."""
    text, tokens, error = "", [], None

    async def read_async() -> None:
        nonlocal text, error
        try:
            async for delta in stream:
                text += delta.text
                tokens.extend(delta.token_ids)
        except Exception as err:  # noqa: BLE001 - what the reader got is the test
            error = err

    if asynchronous:
        asyncio.run(read_async())
        return text, tokens, error
    try:
        for delta in stream:
            text += delta.text
            tokens.extend(delta.token_ids)
    except Exception as err:  # noqa: BLE001 - what the reader got is the test
        error = err
    return text, tokens, error


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("gather", [1, 4])
@pytest.mark.parametrize("how", ["error", "unasked abort"])
def test_a_stream_that_fails_hands_over_the_text_it_held_for_a_stop_string_first(
        smollm2_tokenizer, how, gather, asynchronous):
    """The tail that might begin a stop string was held back, and a failure raised at once: the
    reader had every token but not their text. It now gets that text in a last delta, then the error."""
    from workers.serving.requests import TokenEvent

    ids = smollm2_tokenizer.encode(HELD_TEXT)
    stream, handle = stream_with_a_stop_string(smollm2_tokenizer, gather, asynchronous)
    for token in ids:
        handle.deliver(TokenEvent("r1", [token]))
    if how == "error":
        handle.fail(RequestFailed("request r1 failed: its group broke"))
        expected = RequestFailed
    else:  # the group dropped it (it is stopping) without the reader's cancel
        handle.deliver(TokenEvent("r1", [], "abort"))
        expected = RequestCancelled
    text, tokens, error = read_until_it_fails(stream, asynchronous)
    assert type(error) is expected, error
    assert tokens == ids and text == smollm2_tokenizer.decode(ids) == HELD_TEXT
    assert read_until_it_fails(stream, asynchronous)[2] is not None  # a later read raises it again


def test_a_resumed_stream_still_holds_back_a_stop_strings_start_until_it_is_complete(smollm2_tokenizer):
    """A group fault resumes the request on a new group (no error reaches the reader): the held
    tail stays held, and the token that completes the stop string ends the text before it."""
    from workers.serving.requests import TokenEvent

    ids, [bang] = smollm2_tokenizer.encode(HELD_TEXT), smollm2_tokenizer.encode("!")
    stream, handle = stream_with_a_stop_string(smollm2_tokenizer)
    for token in ids[:-1]:
        handle.deliver(TokenEvent("r1", [token]))
    handle.deliver(TokenEvent("r1", [ids[-1]]))  # the first group's last token, then the resumed one's
    handle.deliver(TokenEvent("r1", [bang], cached_tokens=2))
    deltas = list(stream)
    assert "".join(d.text for d in deltas) == "Hello world, this is "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stopped_by_string
    assert [t for d in deltas for t in d.token_ids] == ids + [bang]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_reader_waits_for_its_replica_until_a_grace_past_the_deadline_not_from_each_read(
        monkeypatch, asynchronous):
    """_GRACE_S is beyond the request's deadline: a read waited timeout_s + _GRACE_S from itself,
    so a read made near the deadline waited almost a whole timeout more."""
    from launcher.serving import request_streams

    monkeypatch.setattr(request_streams, "_GRACE_S", 0.2)
    stream, handle = async_stream() if asynchronous else thread_stream()  # 5 s request timeout
    handle.deadline = time.monotonic() + 0.5  # most of its timeout has passed
    start = time.monotonic()
    error = read_until_it_fails(stream, asynchronous)[2]
    waited = time.monotonic() - start
    assert type(error) is RequestTimeout, error
    assert 0.6 <= waited < 3.0, waited  # 0.5 s to the deadline + 0.2 s; not the whole 5 s again
    assert re.search(r"no answer within 0\.[67] s, and is now at least 0\.2 s past its request timeout \(5 s",
                     str(error)), error
