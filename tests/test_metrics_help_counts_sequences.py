"""/metrics' HELP for corelaunch_requests_running and _waiting says what ReplicaPool.load counts:
engine sequences, one per choice (a request with n=4 shows running 4), waiting being those beyond
--max-num-seqs. It said "Requests", which a request with n choices is not."""

from __future__ import annotations

import re

from launcher.serving.metrics import ServerMetrics


def _help(text: str, name: str) -> str:
    return re.search(rf"^# HELP {name} (.*)$", text, re.MULTILINE).group(1)


def test_the_load_gauges_count_sequences_and_say_so():
    metrics = ServerMetrics(lambda: {"running": 4, "waiting": 0})  # one request, n=4
    text = metrics.render().decode()
    assert "corelaunch_requests_running 4.0" in text  # read from load() at the scrape
    running, waiting = _help(text, "corelaunch_requests_running"), _help(text, "corelaunch_requests_waiting")
    assert running.startswith("Sequences in the running batch") and "a request with n choices counts n" in running
    assert waiting.startswith("Sequences (choices) queued for a slot") and "--max-num-seqs" in waiting
