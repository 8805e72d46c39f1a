"""A stream sent from another thread while Launcher.start() still loads its groups, with real Ray and
the built-in demo model (SmolLM2-135M): it runs once the group is up, and leaves nothing owed.

A review found it booked on the "starting" replica and never handed over: it timed out, its cancel
went to a leader that never had the id, and the id (and its cache row) stayed taken for good. The
pool's logic alone, in milliseconds: tests/test_replica_pool.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from launcher.api import Launcher
from launcher.errors import LaunchError

TIMEOUT_S = 120


@pytest.mark.slow
def test_a_stream_sent_while_the_launcher_starts_runs_once_its_group_is_up(ray_session, monkeypatch):
    from shardlib.demo_model import ensure_demo_model

    sent = threading.Event()
    real_new_group = Launcher._new_group

    def after_the_stream_is_sent(self, *args, **kwargs):  # the group starts only once the test has sent it
        assert sent.wait(TIMEOUT_S), "the test never sent its stream"
        return real_new_group(self, *args, **kwargs)

    monkeypatch.setattr(Launcher, "_new_group", after_the_stream_is_sent)
    llm = Launcher(model=str(ensure_demo_model()), tp=1, seq_len=256, max_num_seqs=2, progress=False,
                   compile=False, request_timeout_s=60)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            llm.start()
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread below
            errors.append(err)
            sent.set()

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while llm._pool is None or llm._pool.replicas[0].state != "starting":
            assert not errors, errors
            assert time.monotonic() < deadline, "the pool never showed a starting replica"
            time.sleep(0.01)
        replica = llm._pool.replicas[0]
        # a text prompt needs the tokenizer start() is still loading: said so, not "no tokenizer files"
        with pytest.raises(LaunchError, match="still starting"):
            llm.stream("Hello", max_new_tokens=4)
        stream = llm.stream([1, 504, 3458], max_new_tokens=4, ignore_eos=True)
        assert replica.state == "starting"  # sent while it started: the case under test
        sent.set()
        tokens, finish = [], None
        for delta in stream:
            tokens.extend(delta.token_ids)
            finish = delta.finish_reason
        assert finish == "length" and len(tokens) == 4
        starter.join(TIMEOUT_S)
        assert not starter.is_alive() and not errors, errors
        assert replica.state == "serving" and replica.cancelling == set()
        assert replica.rows_taken() == 0 and llm.load() == {"running": 0, "waiting": 0}
        again = list(llm.stream([1, 504, 3458], max_new_tokens=2, ignore_eos=True, request_id=stream.request_id))
        assert again[-1].finish_reason == "length"  # its id is free again
    finally:
        sent.set()
        starter.join(TIMEOUT_S)
        llm.shutdown(grace_s=1)
