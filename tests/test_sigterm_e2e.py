"""SIGTERM to the one-shot commands with real processes (slow): `kill PID`, `timeout` and
`kill -- -PGID` (which reach Ray's own processes too) stop a generate as Ctrl-C does: exit 143
within seconds, one line, nothing left running. Before, the command got Ray's handlers: a stack
dump and exit 134 once Ray ran, or a 60 s wait for a GCS that the signal had ended (exit 1)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_hardening_e2e import (assert_nothing_left, assert_signalled_while_generating, clean_env,
                                      long_generate_command, long_run_model, signal_when_ready)  # noqa: F401 - long_run_model: a fixture

REPO = Path(__file__).parent.parent

AFTER_RAY_INIT = textwrap.dedent("""
    import ctypes, os, signal, time
    from launcher import termination
    from launcher.cluster import ray_cluster

    class Action(ctypes.Structure):  # glibc's struct sigaction
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                    ("restorer", ctypes.c_void_p)]

    class Symbol(ctypes.Structure):  # Dl_info
        _fields_ = [("file", ctypes.c_char_p), ("base", ctypes.c_void_p), ("name", ctypes.c_char_p),
                    ("address", ctypes.c_void_p)]

    def handler_library(signum):
        libc = ctypes.CDLL(None)
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(Symbol)]
        action, symbol = Action(), Symbol()
        libc.sigaction(signum, None, ctypes.byref(action))
        libc.dladdr(action.handler, ctypes.byref(symbol))
        return os.path.basename(symbol.file.decode()) if symbol.file else str(action.handler)

    with termination.sigterm_raises_terminated():
        connection = ray_cluster.connect(None)
        print("ours after ray.init", termination.installed(), flush=True)
        print("SIGSEGV handled by Ray's", "_raylet" in handler_library(signal.SIGSEGV), flush=True)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        except termination.Terminated:
            print("raised", flush=True)
        connection.close()
    print("closed", flush=True)
""")


@pytest.mark.slow
def test_after_ray_init_sigterm_still_raises_the_clis_interrupt():
    """ray.init installed Ray's handlers over the CLI's; its core worker's C++ failure handler then
    answered SIGTERM with a stack dump and SIGABRT (exit 134). That handler is not installed at all
    in the CLI (it took SIGTERM while ray.init ran, before the CLI's was put back): the crash
    signals are Python's faulthandler's, which ray.init enables."""
    run = subprocess.run([sys.executable, "-c", AFTER_RAY_INIT], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env=clean_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n") == ["ours after ray.init True", "SIGSEGV handled by Ray's False", "raised",
                                       "closed", ""], run.stderr[-3000:]


# exclusive: these watch the session's processes and /dev/shm, and time the exit
@pytest.mark.slow
@pytest.mark.exclusive
@pytest.mark.parametrize("target, when", [("pid", "generating"), ("group", "generating"), ("pid", "starting"),
                                          ("group", "ray-starting")])
def test_sigterm_stops_a_generate_within_seconds_leaving_nothing(long_run_model, target, when):  # noqa: F811
    """target pid: `kill PID` (systemd's default, `ray job stop`); group: `kill -- -PGID` or
    `timeout`, which reach Ray's GCS and raylet at the same moment. when starting: as the ranks are
    placed and start (the tiny model's load takes milliseconds; the launcher's shutdown then waits for the start's threads before Ray
    closes); ray-starting: inside ray.init (sent to the group, ray.init waited 60 s for the GCS the
    signal had ended, then exit 1)."""
    segments_before = set(glob.glob("/dev/shm/corelaunch-*"))
    # Not --quiet: the progress lines say when Ray is up and when the generation begins; 1.5 s
    # after the start is well into the generation (two prompts of thousands of tokens each).
    send = (lambda pid: os.kill(pid, signal.SIGTERM)) if target == "pid" else (
        lambda pid: os.killpg(pid, signal.SIGTERM))
    marker, after_s = {"generating": ("✓ starting", 1.5), "starting": ("✓ connecting to Ray", 0.0),
                       "ray-starting": ("✓ loading tokenizer", 1.0)}[when]
    code, err, took_s, sid = signal_when_ready(long_generate_command(long_run_model, "t5 t9", "t7 t33"), marker,
                                               after_s, send)
    too_late = {"starting": "✓ starting", "ray-starting": "✓ connecting to Ray"}.get(when)
    assert too_late is None or too_late not in err, f"the signal came after the phase it is for:\n{err[-3000:]}"
    assert_signalled_while_generating(err)
    assert code == 143, err[-3000:]
    assert "corelaunch: terminated (SIGTERM)" in err, err[-3000:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert took_s < 10.0, f"SIGTERM took {took_s:.1f} s to end the command"
    assert_nothing_left(sid, segments_before)
