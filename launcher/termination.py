"""SIGTERM as a request to stop, handled the way Ctrl-C is, for the CLI's one-shot commands.

`kill PID`, `timeout`, systemd and `ray job stop` send SIGTERM. Without a handler of ours, the
command got Ray's: before ray.init Python's default (killed at once, the demo model's half-written
conversion folder left behind), during ray.init Ray's `sys.exit(15)` (a private cluster's agents
outlived the command by about 30 s), and after it Ray's C++ failure handler (a stack dump on stderr
and exit 134 through SIGABRT). Raised as a KeyboardInterrupt, SIGTERM takes every path Ctrl-C
takes: requests cancelled, ranks and Ray stopped within a short grace, temporary folders removed.

A signal sent to the whole process group (`timeout`, `kill -- -PGID`) reaches the private Ray's own
processes too, and then no Ray call can complete (each waited 60 s for the gone GCS, then the
process exited 1): the handler tells the two apart before any clean-up starts, by watching its
child processes (the private Ray's GCS, raylet, dashboard) for a moment, and in that case exits at
once, removing the directories it was writing (shardlib.atomic_dir).

Only the CLI installs the handler: a program using the driver API keeps whatever SIGTERM does in it
(Ray's handler once Ray has started).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

from shardlib.process_alive import stat_fields

TERMINATED_EXIT = 143
"""The exit code after SIGTERM (128 + 15), as shells report a command killed by it."""
CLEAN_EXIT_WAIT_S = 45.0
"""How long the clean shutdown after SIGTERM may take before the process exits regardless: it
stops the ranks within a second's grace and Ray within a few more (a private cluster on a busy
host), and waits up to 30 s for a --presharded-cache copy being written (launcher/api.py,
HURRIED_CACHE_WAIT_S); whoever sent SIGTERM (systemd, Kubernetes) sends SIGKILL after its own wait."""
GROUP_SIGNAL_WAIT_S = 1.0
"""How long the handler watches this process's children for one to exit before deciding the signal
was its alone: sent to the group, it reaches them within milliseconds, and the private Ray's
Python processes exit on it within a few hundred (more on a loaded host). Only while there are
children: before Ray starts the handler returns at once."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: a KeyboardInterrupt, so every clean-up written for Ctrl-C runs for it too."""


_terminating = threading.Event()
_first_check = threading.RLock()
"""Held for the first SIGTERM's check (note_held) from start to end: the main thread's handler and
held_sigterm_checked_at_once's thread may both see one signal, and the other waits for the answer.
Without the wait ray.init went on meanwhile and shut the private Ray down for a SIGTERM sent to this
process alone, and the check, watching, took the raylet's exit for the signal's. Reentrant: a second
SIGTERM's handler runs on the main thread inside the first's check, and returns (a plain lock
waited for itself there, forever)."""
_ended = threading.Event()
"""Set when sigterm_raises_terminated's block ends: the watchdog then has nothing to end (a CLI run
in-process, `launcher.cli.main([...])`, returns and its caller goes on)."""


def received() -> bool:
    """True once SIGTERM has come inside the block: a KeyboardInterrupt that Ray made of the
    Terminated raised while the main thread waited in a Ray call (Ray's signal check raises a new,
    plain one) is still SIGTERM's."""
    return _terminating.is_set()


def on_sigterm() -> None:
    """What SIGTERM does in the CLI: the first exits at once when it reached the private Ray's
    processes too (see the module docstring), else raises Terminated with a watchdog that ends the
    process should the clean-up not; later ones are ignored (the clean-up under way ends it, as a
    second Ctrl-C is held during a shutdown)."""
    if _terminating.is_set():
        return
    note_held()
    raise_after_hold()


def note_held() -> None:
    """The first SIGTERM's check, for one held while ray.init runs (launcher/cluster/ray_cluster.py):
    exits at once when the signal reached the private Ray's processes too, whose GCS ray.init would
    wait 30 s for (and each later Ray call 60 s)."""
    with _first_check:
        if _terminating.is_set():
            return
        _terminating.set()
        if _ray_going(GROUP_SIGNAL_WAIT_S):
            exit_abandoning("the signal reached Ray's own processes too (sent to the whole process group), so "
                            "there was no cluster left to stop the ranks through; they got it as well")


def raise_after_hold() -> None:
    """Terminated raised, with the watchdog that ends the process should the clean-up not."""
    _terminating.set()
    threading.Thread(target=_exit_unless_shut_down, name="corelaunch-sigterm-watchdog", daemon=True).start()
    raise Terminated


def _raise_terminated(signum, frame) -> None:
    on_sigterm()


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
    _terminating.clear()
    _ended.clear()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _ended.set()


@contextlib.contextmanager
def held_sigterm_checked_at_once():
    """Inside the block a SIGTERM is checked (note_held) on a thread of its own as it arrives, not
    when the main thread is next in the interpreter. ray.init waits in Ray's C++ code for its GCS
    (up to 30 s, the interpreter's signal handlers not run meanwhile): a SIGTERM sent to the whole
    group while it started the private Ray killed that GCS, and the command exited 30 s later.
    Python writes each caught signal's number to the wakeup file descriptor from its C handler, at
    once; the block's thread reads it. Main thread only (elsewhere the block does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # exit_abandoning's import, made here: on the check's thread it could wait for an import lock
    # that the main thread, stopped in a signal handler, holds
    import shardlib.atomic_dir  # noqa: F401

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def check_each_sigterm() -> None:
        with reader:
            while signals := reader.recv(64):  # b"": the block has ended and closed the writer
                if previous >= 0:  # the descriptor's owner (an event loop's signal handling) gets them too
                    with contextlib.suppress(OSError):
                        os.write(previous, signals)
                if signal.SIGTERM in signals:
                    note_held()

    try:
        threading.Thread(target=check_each_sigterm, name="corelaunch-sigterm-check", daemon=True).start()
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.close()


def exit_abandoning(why: str) -> None:
    """Exit 143 now, saying why: the directories this process was writing are removed first (their
    writers will never unwind), nothing else runs. The line goes straight to file descriptor 2:
    sys.stderr's lock may be held by a main thread stuck writing to a reader that stopped."""
    try:
        from shardlib.atomic_dir import remove_unfinished

        remove_unfinished()
        os.write(2, f"corelaunch: terminated (SIGTERM); {why}\n".encode())
    finally:
        os._exit(TERMINATED_EXIT)


def _exit_unless_shut_down() -> None:
    if not _ended.wait(CLEAN_EXIT_WAIT_S):
        exit_abandoning(f"the clean shutdown had not ended {CLEAN_EXIT_WAIT_S:g} s after it")


def _ray_going(within_s: float) -> bool:
    """True when one of the private Ray's own processes has exited, or does within within_s. Python
    runs the handler only when the main thread is back in the interpreter, by when the private
    Ray's Python daemons may be gone already: what counts is that one has gone, not when. Through
    Ray's record of the processes it started once there is one (ray_cluster.private_cluster_dying),
    else (inside ray.init) through /proc. Those already gone when the cluster had started are not
    counted (a Ray process that exited on its own read as the signal reaching the group)."""
    if "ray" in sys.modules:
        from launcher.cluster import ray_cluster

        if ray_cluster.private_node_running():
            return ray_cluster.private_cluster_dying(within_s)
    return _children_exit_within(within_s)


def _children_exit_within(within_s: float) -> bool:
    """True when a child process of this one is a zombie (exited, not yet reaped: while ray.init
    runs, one of the processes it started), or when one from Ray (its GCS, raylet, Python daemons)
    that is running when called exits within within_s. Linux's /proc; False elsewhere."""
    children = _children()
    if any(state == "Z" for state in children.values()):
        return True
    running = {pid for pid in children if _from_ray(pid)}
    if not running:
        return False
    deadline = time.monotonic() + within_s
    while True:
        now = _children()
        if any(now.get(pid, "Z") == "Z" for pid in running):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _from_ray(pid: int) -> bool:
    """A process Ray started: its GCS or raylet binary, or a Python script from Ray's package (not a
    helper such as `neuron-ls` that Ray runs and waits for during ray.init)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(arg.endswith((b"/gcs_server", b"/raylet")) or b"/ray/" in arg for arg in argv)


def _children() -> dict[int, str]:
    """{pid: state letter} of this process's children, from /proc/*/stat; {} without /proc."""
    me, found = os.getpid(), {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        fields = stat_fields(int(entry)) if entry.isdigit() else None  # None: gone meanwhile, or not ours
        if fields is not None and len(fields) > 1 and int(fields[1]) == me:
            found[int(entry)] = fields[0].decode()
    return found
