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
from typing import Any, Callable


class BackgroundLoad:
    def __init__(self, load: Callable[..., Any], *args: Any, name: str = "corelaunch-background-load"):
        self._load, self._args = load, args
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self.elapsed_s = 0.0
        """How long the load itself took (valid once done)."""
        # A daemon: an interrupted start-up must not wait for a load nobody will use.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._value = self._load(*self._args)
        except BaseException as error:  # handed to whoever takes the result
            self._error = error
        finally:
            self.elapsed_s = time.perf_counter() - start
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> Any:
        """The load's value, waiting for it; its exception if it raised; TimeoutError after timeout_s."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self._thread.name} did not finish within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value
