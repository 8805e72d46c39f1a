"""Benchmark scripts that fail early and clearly: argument checks before any work, and a rank that
dies ends the wait at once."""

from __future__ import annotations

import argparse
import multiprocessing
import time

import pytest


def test_allreduce_world_sizes_are_checked_before_any_rank_starts():
    from benchmarks.allreduce import _world_sizes

    assert _world_sizes("2,3") == [2, 3]
    for text in ("0", "1,2", "two", ""):  # --world-sizes 0 ended in a bare queue.Empty traceback
        with pytest.raises(argparse.ArgumentTypeError, match="must be comma-separated integers of at least 2"):
            _world_sizes(text)


def test_allreduce_stops_waiting_when_a_rank_has_died():
    """A dead rank left the driver waiting the whole --timeout-s (600 s by default)."""
    from benchmarks.allreduce import _result

    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=exit, args=(3,))
    dead.start()
    dead.join()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the ranks ended without a report \\(rank 0 exit code 3\\)"):
        _result(ctx.Queue(), [dead], timeout_s=600)
    assert time.monotonic() - start < 10

