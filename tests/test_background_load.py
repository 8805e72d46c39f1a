"""launcher.background_load.BackgroundLoad: a load on a thread, its value, error and duration."""

from __future__ import annotations

import threading
import time

import pytest

from launcher.background_load import BackgroundLoad


def test_the_value_comes_back_with_the_load_s_own_duration():
    load = BackgroundLoad(lambda a, b: (time.sleep(0.2), a + b)[1], 2, 3)
    assert load.result(timeout_s=10) == 5 and load.done()
    assert 0.2 <= load.elapsed_s < 5


def test_the_load_s_exception_is_raised_by_result():
    def broken():
        raise OSError("tokenizer.json: unexpected end of file")

    load = BackgroundLoad(broken)
    with pytest.raises(OSError, match="unexpected end of file"):
        load.result(timeout_s=10)


def test_a_load_past_the_timeout_names_it():
    release = threading.Event()
    load = BackgroundLoad(release.wait, name="the-slow-load")
    try:
        with pytest.raises(TimeoutError, match=r"the-slow-load did not finish within 0\.1 s"):
            load.result(timeout_s=0.1)
        assert not load.done()
    finally:
        release.set()
    assert load.result(timeout_s=10) is True
