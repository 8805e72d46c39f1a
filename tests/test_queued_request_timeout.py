"""A request that times out while it waits for a sequence slot is told so: it was told to ask for
fewer tokens (`max_tokens`), of which it had generated none, where a later retry or more slots
(--max-num-seqs) or a longer --request-timeout would have helped it."""

from __future__ import annotations

import time

import pytest

from launcher.errors import RequestTimeout


def test_a_request_that_never_got_a_slot_is_told_it_waited_for_one(tmp_path, in_process_cluster):
    """Over a real in-process Launcher, one slot: the first request holds it (the default timeout),
    the second, given a short one, waits behind it and times out; then one that held the slot
    times out too and is told as before."""
    from launcher.api import Launcher
    from launcher.serving.openai_app import _generation_failure, _overdue
    from tests.model_factory import random_model_with_smollm2_tokenizer

    model_dir = random_model_with_smollm2_tokenizer(tmp_path)
    with Launcher(model=model_dir, tp=1, max_num_seqs=1, progress=False, compile=False) as llm:
        holder = llm.stream("a", max_new_tokens=150, ignore_eos=True)  # seconds: the other waits 0.3
        next(holder)
        started = time.monotonic()
        llm.config.request_timeout_s = 0.3  # the requests submitted from here on
        with pytest.raises(RequestTimeout) as queued:
            list(llm.stream("b", max_new_tokens=4))
        waited_s = time.monotonic() - started
        holder_done = sum(1 for _ in holder)  # it runs on: the other's timeout did not touch it
        with pytest.raises(RequestTimeout) as running:
            list(llm.stream("c", max_new_tokens=480, ignore_eos=True))
    assert holder_done > 0, waited_s
    assert queued.value.waited_for_a_slot, (str(queued.value), waited_s)
    assert "waited all that time for a sequence slot" in str(queued.value)
    assert "max_num_seqs (--max-num-seqs)" in str(queued.value)
    assert not running.value.waited_for_a_slot and "(it had delivered " in str(running.value)
    # over HTTP: the 504 says it waited, not "ask for fewer tokens with max_tokens"
    status, body, _ = _generation_failure(queued.value, overdue=_overdue("chatcmpl-1", 0.3, [0], [None], True),
                                          waited_for_a_slot=True)
    message = body["error"]["message"]
    assert status == 504 and body["error"]["code"] == "generation_timeout"
    assert message == ("response chatcmpl-1 did not finish within the request timeout (0.3 s): it waited all that "
                       "time for a sequence slot, every one busy with other requests; retry it later, or have the "
                       "server's operator raise its --max-num-seqs or --request-timeout")
    status, body, _ = _generation_failure(running.value, overdue=_overdue("chatcmpl-2", 0.3, [5], [None]))
    assert status == 504 and "ask for fewer tokens with max_tokens" in body["error"]["message"]
