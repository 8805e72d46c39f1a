"""One slow, independent load run on a thread while the caller goes on: the driver's tokenizer
loads while Ray starts and the ranks load their shards.

Loading a Hugging Face tokenizer in a fresh process imports transformers, which imports torch:
3-5 s on a 2-core host, spent by a process that then mostly waits for Ray and for the ranks. The
result (or the exception, re-raised) is taken with result(); the load's own duration is kept for
the start-up progress lines.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable


class BackgroundLoad:
    def __init__(self, load: Callable[..., Any], *args: Any, name: str = "corelaunch-background-load"):
        self._load, self._args, self._name = load, args, name
        self._future: Future = Future()
        self.elapsed_s = 0.0
        """How long the load itself took (valid once done)."""
        # A daemon: an interrupted start-up must not wait for a load nobody will use.
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        start = time.perf_counter()
        value, error = None, None
        try:
            value = self._load(*self._args)
        except BaseException as caught:  # handed to whoever takes the result
            error = caught
        self.elapsed_s = time.perf_counter() - start  # set before the future wakes the waiter
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)

    def done(self) -> bool:
        return self._future.done()

    def failed(self) -> bool:
        """Whether it has finished by raising (without waiting)."""
        return self._future.done() and self._future.exception() is not None

    def result(self, timeout_s: float | None = None) -> Any:
        """The load's value, waiting for it; its exception if it raised; TimeoutError after timeout_s."""
        finished, _ = wait([self._future], timeout_s)
        if not finished:  # (a TimeoutError the load itself raised is its result, and re-raised as such)
            raise TimeoutError(f"{self._name} did not finish within {timeout_s} s")
        return self._future.result()
