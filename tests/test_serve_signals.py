"""How `corelaunch serve` takes its stop signals (the whole server, stopped by a group's SIGTERM, is
tested in test_openai_server.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SECOND_SIGNAL = """
import os, signal
from launcher.cli.serve_command import StopSignals

before = signal.getsignal(signal.SIGTERM)
signals = StopSignals()
signals.install()
os.kill(os.getpid(), signal.SIGTERM)
assert signals.requested.is_set() and signals.by_sigterm and not signals.cut_short
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    assert signals.cut_short
    print("cut short")
with signals.held():  # Ray shutting down: a further signal must not interrupt it half-way
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    print("held")
assert signal.getsignal(signal.SIGTERM) is before  # the handlers found at install(), back
"""


def test_a_second_signal_cuts_the_graceful_shutdown_short():
    """The first SIGTERM asks to stop (and is known to be a SIGTERM); a second signal interrupts
    whatever the main thread waits on. A second one used to be taken as the first again, leaving
    Serve's shutdown to wait its 30 s."""
    out = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["cut", "short", "held"], out.stderr


def test_a_first_sigint_is_not_taken_for_a_sigterm():
    code = SECOND_SIGNAL.replace("signal.SIGTERM)\nassert signals.requested.is_set() and signals.by_sigterm",
                                 "signal.SIGINT)\nassert signals.requested.is_set() and not signals.by_sigterm")
    assert code != SECOND_SIGNAL
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["cut", "short", "held"], out.stderr


def test_no_private_cluster_is_never_taken_for_a_dying_one():
    """Without a Ray this process started there is nothing whose death means a group's signal."""
    from launcher.cluster.ray_cluster import dead_private_processes, private_cluster_dying

    assert private_cluster_dying(within_s=0.0) is False and dead_private_processes() == frozenset()
