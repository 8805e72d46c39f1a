"""The driver's shared tokenizer is taken a prompt at a time and handed over to a caller that found
it taken (launcher/api.py, Launcher._encode). The waits are measured by
benchmarks/tokenizer_lock.py; this checks the protocol, without timing."""

from __future__ import annotations

import threading

from launcher.api import Launcher


class GatedTokenizer:
    """Counts its encodes (each must run under the Launcher's lock); a text with a gate waits for it."""

    def __init__(self, lock, gates: dict[str, threading.Event]):
        self.lock, self.gates, self.calls = lock, gates, 0

    def __call__(self, text):
        assert self.lock.locked()  # every encode under the Launcher's lock
        self.calls += 1
        gate = self.gates.get(text)
        if gate is not None:
            assert gate.wait(10), f"{text!r} was never let through"
        return {"input_ids": [len(text)]}


def test_a_caller_that_finds_the_tokenizer_taken_is_handed_it_and_the_holder_yields(monkeypatch):
    llm = Launcher(progress=False)
    holding, waiting = threading.Event(), threading.Event()
    llm.tokenizer = GatedTokenizer(llm._lock, {"holder": holding, "waiter": waiting})
    yields = []
    real_sleep = __import__("time").sleep
    monkeypatch.setattr("launcher.api.time.sleep",
                        lambda s: (yields.append((threading.current_thread().name, s)), real_sleep(s)))
    done = {}
    holder = threading.Thread(target=lambda: done.update(holder=llm._encode("holder")), name="holder")
    holder.start()  # mid-encode, the lock held, until its gate opens
    for _ in range(10_000):  # bounded: a holder that failed before taking the lock must not hang the test
        if llm._lock.locked():
            break
        real_sleep(0.001)
    assert llm._lock.locked(), "the holder never took the tokenizer's lock"
    waiter = threading.Thread(target=lambda: done.update(waiter=llm._encode("waiter")), name="waiter")
    waiter.start()
    assert llm._tokenizer_wanted.wait(10), "the waiter did not say it wants the tokenizer"
    holding.set()
    holder.join(10)
    # the holder's release saw the request, cleared it and yielded once; the waiter, which cannot
    # have cleared it (it is held mid-encode by its gate), now has the lock
    assert done == {"holder": [6]} and yields == [("holder", 0)] and not llm._tokenizer_wanted.is_set()
    for _ in range(10_000):  # the waiter takes the lock and reaches its gate
        if llm.tokenizer.calls == 2:
            break
        real_sleep(0.001)
    assert llm.tokenizer.calls == 2 and llm._lock.locked()
    waiting.set()
    waiter.join(10)
    assert done == {"holder": [6], "waiter": [6]} and not llm._lock.locked()
    # uncontended, no yield: a bulk call goes a prompt at a time, the lock free between prompts
    assert llm._tokenize(["a", "bb", "ccc"]) == (["a", "bb", "ccc"], [[1], [2], [3]])
    assert llm.tokenizer.calls == 5 and yields == [("holder", 0)] and not llm._lock.locked()
