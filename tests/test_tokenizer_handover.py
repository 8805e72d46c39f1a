"""The driver's shared tokenizer is taken a prompt at a time and handed over to a caller that found
it taken (launcher/api.py, Launcher._encode). The waits are measured by
benchmarks/tokenizer_lock.py; this checks the protocol, without timing."""

from __future__ import annotations

import threading

from launcher.api import Launcher


class CountingTokenizer:
    def __init__(self, lock):
        self.lock, self.calls = lock, 0

    def __call__(self, text):
        assert self.lock.locked()  # every encode under the Launcher's lock
        self.calls += 1
        return {"input_ids": [len(text)]}


def test_a_caller_that_finds_the_tokenizer_taken_is_handed_it_and_the_holder_yields():
    llm = Launcher(progress=False)
    llm.tokenizer = CountingTokenizer(llm._lock)
    llm._lock.acquire()  # another thread mid-encode
    done = []
    waiter = threading.Thread(target=lambda: done.append(llm._encode("abc")))
    waiter.start()
    try:
        assert llm._tokenizer_wanted.wait(10), "the waiter did not say it wants the tokenizer"
    finally:
        llm._lock.release()
    waiter.join(10)
    assert done == [[3]] and not llm._lock.locked()
    # the holder's next release sees the request, clears it (and yields once)
    assert llm._encode("hello") == [5] and not llm._tokenizer_wanted.is_set()
    # a bulk call goes a prompt at a time: the lock is free between prompts, and each is encoded
    assert llm._tokenize(["a", "bb", "ccc"]) == (["a", "bb", "ccc"], [[1], [2], [3]])
    assert llm.tokenizer.calls == 5 and not llm._lock.locked()
