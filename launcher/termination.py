"""SIGTERM as a request to stop, handled the way Ctrl-C is, for the CLI's one-shot commands.

`kill PID`, `timeout`, systemd and `ray job stop` send SIGTERM. Without a handler of ours, the
command got Ray's: before ray.init Python's default (killed at once, the demo model's half-written
conversion folder left behind), during ray.init Ray's `sys.exit(15)` (a private cluster's agents
outlived the command by about 30 s), and after it Ray's C++ failure handler (a stack dump on stderr
and exit 134 through SIGABRT). Raised as a KeyboardInterrupt, SIGTERM takes every path Ctrl-C
takes: requests cancelled, ranks and Ray stopped within a short grace, temporary folders removed.

Only the CLI installs the handler: a program using the driver API keeps whatever SIGTERM does in it
(Ray's handler once Ray has started).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

TERMINATED_EXIT = 143
"""The exit code after SIGTERM (128 + 15), as shells report a command killed by it."""
CLEAN_EXIT_WAIT_S = 45.0
"""How long the clean shutdown after SIGTERM may take before the process exits regardless: it
stops the ranks within a second's grace and Ray within a few more (a private cluster on a busy
host), and waits up to 30 s for a --presharded-cache copy being written (launcher/api.py,
HURRIED_CACHE_WAIT_S); whoever sent SIGTERM (systemd, Kubernetes) sends SIGKILL after its own wait."""
CLUSTER_DYING_WAIT_S = 1.0
"""How long after SIGTERM the process watches for a private Ray's own processes to exit: a signal
sent to the whole process group (`timeout`, `kill -- -PGID`, a terminal's job control) reaches
them as well, within milliseconds."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: a KeyboardInterrupt, so every clean-up written for Ctrl-C runs for it too."""


_watchdog_started = threading.Event()


def raise_terminated() -> None:
    """Raise Terminated, with a watchdog that ends the process if the clean shutdown cannot run or
    does not end: a private Ray whose processes got SIGTERM too left each Ray call of the shutdown
    waiting 60 s for a GCS that was gone (Ray's reconnect timeout), then exit 1."""
    if not _watchdog_started.is_set():
        _watchdog_started.set()
        threading.Thread(target=_exit_unless_shut_down, name="corelaunch-sigterm-watchdog", daemon=True).start()
    raise Terminated


def _raise_terminated(signum, frame) -> None:
    raise_terminated()


def _exit_unless_shut_down() -> None:
    from launcher.cluster import ray_cluster

    started = time.monotonic()
    # Only where Ray is loaded: importing it here (seconds) would be a waste before Ray starts
    if "ray" in sys.modules and ray_cluster.private_cluster_dying(CLUSTER_DYING_WAIT_S):
        why = ("Ray's own processes got the signal too, so there was no cluster left to stop the ranks through; "
               "they got it as well")
    else:
        time.sleep(max(0.0, CLEAN_EXIT_WAIT_S - (time.monotonic() - started)))
        why = f"the clean shutdown had not ended {CLEAN_EXIT_WAIT_S:g} s after it"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a reader that left: nothing more to say to it
            pass
    try:
        sys.stderr.write(f"corelaunch: terminated (SIGTERM); {why}\n")
        sys.stderr.flush()
    finally:
        os._exit(TERMINATED_EXIT)


def installed() -> bool:
    """True when SIGTERM raises Terminated in this process (the CLI set it up)."""
    return signal.getsignal(signal.SIGTERM) is _raise_terminated


def reinstall() -> None:
    """The handler put back over whatever replaced it (ray.init installs Ray's), main thread only.
    Python's signal.signal sets the process's action too, over a handler installed from C."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def sigterm_raises_terminated():
    """SIGTERM raises Terminated in the main thread inside the block; the action before it is
    restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
